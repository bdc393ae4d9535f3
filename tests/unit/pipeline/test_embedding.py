"""The Embedding op with a scripted resource manager: what it traces into, what it sends, what it gives back; and
the ResourceManager's ``embed`` (slots, metrics, errors) with a scripted client."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

import app.pipeline.functional as F
from app.pipeline import (
    ConfigurationError,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EndpointConfig,
    InferenceGraph,
    LLMInference,
    Module,
    ResourceManager,
    run,
    trace,
)
from app.pipeline.execution.node_runner import is_embedding_call
from app.pipeline.resources import RateLimitError, embeddings_payload, parse_embeddings
from app.pipeline.resources.client import register_client_factory
from app.pipeline.values import Value, ValueKind
from tests.support.fakes import ScriptedResources, fake_vector


class SummariseThenEmbed(Module):
    def __init__(self) -> None:
        super().__init__()
        self.summarise = LLMInference("fast")
        self.embed = Embedding("vectors", dimensions=3)

    def forward(self, text: Any) -> dict[str, Any]:
        summary = self.summarise(f"Summarise: {text}")
        return {"summary": summary, "vector": self.embed(summary), "raw": self.embed([text, "second text"])}


# ---------------------------------------------------------------------------------------------- the module
async def test_a_text_gives_one_vector_and_a_list_gives_vectors(resources: ScriptedResources) -> None:
    embed = Embedding("vectors")
    assert await run(embed, "hello world", resources=resources) == fake_vector("hello world")
    assert await run(embed, ["a", "bb cc"], resources=resources) == [fake_vector("a"), fake_vector("bb cc")]
    assert await run(embed, [], resources=resources) == []  # nothing to embed: no request
    assert [(alias, r.input) for alias, r in resources.embed_requests] == [
        ("vectors", "hello world"), ("vectors", ["a", "bb cc"])]
    # token ids: one list is one input, a list of lists several
    assert await run(embed, [5, 6], resources=resources) == fake_vector("5 6")
    assert await run(embed, [[5, 6], [7]], resources=resources) == [fake_vector("5 6"), fake_vector("7")]


async def test_in_a_pipeline_with_dimensions_and_meta(resources: ScriptedResources) -> None:
    pipeline = SummariseThenEmbed()
    output, record = await run(pipeline, "some review", resources=resources, record=True)
    assert output["summary"] == "fast(Summarise: some review)"
    assert output["vector"] == fake_vector("fast(Summarise: some review)", 3)
    assert output["raw"] == [fake_vector("some review", 3), fake_vector("second text", 3)]
    json.dumps(output)  # plain JSON data: it travels through checkpoints, workers and job results
    values = [v for v in record.node_values.values() if v.meta.get("alias") == "vectors"]
    assert len(values) == 2 and all(v.kind is ValueKind.STRUCTURED for v in values)
    meta = values[0].meta
    assert meta["model"] == "fake-embed" and meta["dimensions"] == 3 and meta["output_tokens"] == 0
    assert meta["input_tokens"] in (2, 4)
    assert {r.dimensions for _, r in resources.embed_requests} == {3}


async def test_per_call_dimensions_and_extra_body(resources: ScriptedResources) -> None:
    class Call(Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Embedding("e", dimensions=4)

        def forward(self, text: Any) -> Any:
            return self.embed(text, dimensions=2, extra_body={"user": "u1"})

    assert await run(Call(), "abc", resources=resources) == fake_vector("abc", 2)
    request = resources.embed_requests[0][1]
    assert request.dimensions == 2 and request.extra_body == {"user": "u1"}


@pytest.mark.parametrize(("payload", "message"), [
    ("", "empty string"),
    (["a", ""], "input[1] is empty"),
    ({"text": "a"}, "a string or a list of strings (or token ids), not dict"),
    (["a", 3.5], "input[1] is a float"),
    (["a", [1, 2]], "mixes strings and token ids"),
])
async def test_inputs_it_cannot_send_fail_naming_the_node(resources: ScriptedResources, payload: Any,
                                                           message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        await run(Embedding("e"), payload, resources=resources)
    assert resources.embed_requests == []


async def test_an_upstream_error_passes_through_without_a_request() -> None:
    resources = ScriptedResources(reply=lambda alias, request: RuntimeError("the LLM broke"))
    with pytest.raises(RuntimeError, match="the LLM broke"):
        await run(SummariseThenEmbed(), "x", resources=resources)
    assert [r.input for _, r in resources.embed_requests] == [["x", "second text"]]  # only the independent call


def test_it_traces_into_an_endpoint_call_node_of_its_own_config() -> None:
    graph = trace(SummariseThenEmbed(), "x")
    embeds = [n for n in graph.nodes.values() if n.module_name == "Embedding"]
    assert len(embeds) == 2
    assert all(n.kind == "llm" and n.alias == "vectors" and is_embedding_call(n) for n in embeds)
    assert embeds[0].config() == {"alias": "vectors", "call": "embeddings", "dimensions": 3}
    chat = next(n for n in graph.nodes.values() if n.module_name == "LLMInference")
    assert not is_embedding_call(chat)
    # a graph read back without its module keeps the kind and the alias (workers route by them)
    loaded = InferenceGraph.from_dict(json.loads(graph.to_json()))
    assert {n.kind for n in loaded.nodes.values() if n.module_name == "Embedding"} == {"llm"}
    assert {n.alias for n in loaded.nodes.values() if n.module_name == "Embedding"} == {"vectors"}
    # the dimensions are part of the pipeline: they change its hash
    other = SummariseThenEmbed()
    other.embed.dimensions = 8
    assert trace(other, "x").compute_hash() != graph.compute_hash()


def test_bad_construction_and_direct_calls() -> None:
    with pytest.raises(ValueError, match="alias"):
        Embedding("")
    with pytest.raises(ValueError, match="dimensions"):
        Embedding("e", dimensions=0)
    with pytest.raises(RuntimeError, match="runs through the runtime"):
        Embedding("e")("text")
    assert repr(Embedding("e", dimensions=5)) == "Embedding(alias='e', dimensions=5)"


async def test_without_resources_it_says_what_to_give() -> None:
    with pytest.raises(ConfigurationError, match="needs the endpoint alias 'e'"):
        await run(Embedding("e"), "x")


# ---------------------------------------------------------------------------------------------- F.embed
class FakeEmbedClient:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.requests: list[EmbeddingRequest] = []

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.requests.append(request)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome if isinstance(self.outcome, EmbeddingResponse) else EmbeddingResponse(
            [fake_vector(i) for i in request.inputs()], model="m", input_tokens=7)

    async def complete(self, request: Any) -> Any:
        raise AssertionError("an embeddings client is not asked for chats here")

    async def aclose(self) -> None:
        pass


async def test_functional_embed() -> None:
    client = FakeEmbedClient(None)
    one = await F.embed(client, "hi", model="m", dimensions=2)
    assert one.kind is ValueKind.STRUCTURED and one.payload == fake_vector("hi")
    assert one.meta["input_tokens"] == 7 and one.meta["model"] == "m"
    assert client.requests[0].extra_body == {"model": "m"} and client.requests[0].dimensions == 2
    many = await F.embed(client, Value(ValueKind.STRUCTURED, ["a", "b"]))
    assert many.payload == [fake_vector("a"), fake_vector("b")]
    failed = await F.embed(FakeEmbedClient(RateLimitError("slow down")), "x")
    assert failed.kind is ValueKind.ERROR and failed.meta["http_status"] == 429
    upstream = Value(ValueKind.ERROR, ValueError("before"), "n1")
    assert (await F.embed(client, upstream)).payload is upstream.payload


# ---------------------------------------------------------------------------------------------- wire format
def test_payload_and_parsing() -> None:
    request = EmbeddingRequest(["a", "b"], dimensions=8, extra_body={"user": "u"})
    assert embeddings_payload(request, model="text-embedding-3-small") == {
        "input": ["a", "b"], "encoding_format": "float", "model": "text-embedding-3-small", "dimensions": 8,
        "user": "u"}
    answer: dict[str, Any] = {"object": "list", "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3},
              "data": [{"object": "embedding", "index": 1, "embedding": "AACAPwAAAMA="},  # base64 of [1.0, -2.0]
                       {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]}
    parsed = parse_embeddings(answer, 2, 12.0)
    assert parsed.embeddings == [[0.5, 0.25], [1.0, -2.0]] and parsed.model == "m"
    assert parsed.input_tokens == 3 and parsed.completion_time_ms == 12.0
    with pytest.raises(ValueError, match="1 vectors for 2 inputs"):
        parse_embeddings({"data": [answer["data"][0]]}, 2)


# ---------------------------------------------------------------------------------------------- the manager
class ScriptedEmbedClient(FakeEmbedClient):
    in_flight = 0
    peak = 0

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        type(self).in_flight += 1
        type(self).peak = max(type(self).peak, type(self).in_flight)
        try:
            await asyncio.sleep(0.01)
            return await super().embed(request)
        finally:
            type(self).in_flight -= 1


async def test_manager_embed_holds_the_endpoint_limits_and_counts_tokens() -> None:
    previous = register_client_factory("vllm", lambda config: ScriptedEmbedClient(None))
    try:
        manager = ResourceManager({"e": EndpointConfig("vllm", "emb", max_concurrent=2)})
        answers = await asyncio.gather(*(manager.embed("e", EmbeddingRequest(f"t{i}")) for i in range(6)))
        assert [a.embeddings for a in answers] == [[fake_vector(f"t{i}")] for i in range(6)]
        assert ScriptedEmbedClient.peak == 2
        assert all(a.queue_time_ms is not None and a.completion_time_ms is not None for a in answers)
        metrics = manager.metrics("e")
        assert metrics.successes == 6 and metrics.input_tokens == 42 and metrics.output_tokens == 0
        await manager.aclose()
    finally:
        register_client_factory("vllm", previous)


async def test_manager_embed_on_a_chat_only_client_is_a_configuration_error() -> None:
    class ChatOnly:
        async def complete(self, request: Any) -> Any:
            raise AssertionError

        async def aclose(self) -> None:
            pass

    previous = register_client_factory("vllm", lambda config: ChatOnly())
    try:
        manager = ResourceManager({"e": EndpointConfig("vllm", "chat")})
        with pytest.raises(ConfigurationError, match="does not serve embeddings"):
            await manager.embed("e", EmbeddingRequest("x"))
        assert manager.metrics("e").failures == 1
    finally:
        register_client_factory("vllm", previous)
