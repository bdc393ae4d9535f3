"""The Embedding op over HTTP: the OpenAI-compatible client's ``/v1/embeddings`` against the fake server on loopback,
through the ResourceManager (its rate limiter's 429 backoff, concurrency cap and metrics) and ``run()``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.pipeline import (
    Embedding,
    EmbeddingRequest,
    EndpointConfig,
    LLMInference,
    Module,
    ResourceManager,
    run,
)
from app.pipeline.resources import OpenAICompatibleClient, RateLimitError, ResourceError
from app.testing import FakeLLMServer
from app.testing.fake_llm_server import fake_embedding

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as srv:
        yield srv


def endpoint(srv: FakeLLMServer, **kw: Any) -> EndpointConfig:
    return EndpointConfig("vllm", "embedder", base_url=srv.base_url, **kw)


class Pipeline(Module):
    def __init__(self) -> None:
        super().__init__()
        self.answer = LLMInference("chat")
        self.embed = Embedding("vectors", dimensions=3)

    def forward(self, question: Any) -> dict[str, Any]:
        answer = self.answer(question)
        return {"answer": answer, "vectors": self.embed([question, answer])}


async def test_run_a_pipeline_with_chats_and_embeddings_over_http(server: FakeLLMServer) -> None:
    resources = {"chat": endpoint(server), "vectors": endpoint(server, max_concurrent=2)}
    output = await run(Pipeline(), "what is up", resources=resources)
    assert output == {"answer": "echo: what is up",
                      "vectors": [fake_embedding("what is up", 3), fake_embedding("echo: what is up", 3)]}
    assert await run(Embedding("vectors"), "one", resources=resources) == fake_embedding("one")


async def test_the_client_decodes_base64_and_keeps_the_order(server: FakeLLMServer) -> None:
    client = OpenAICompatibleClient(endpoint(server))
    try:
        as_base64 = await client.embed(EmbeddingRequest(["ab", "c d"], extra_body={"encoding_format": "base64"}))
        as_floats = await client.embed(EmbeddingRequest([[1, 2], [3]]))
    finally:
        await client.aclose()
    assert as_base64.embeddings == [fake_embedding("ab"), fake_embedding("c d")]
    assert as_base64.model == "embedder" and as_base64.input_tokens == 3
    assert as_floats.embeddings == [fake_embedding("1 2"), fake_embedding("3")]


async def test_429s_slow_the_alias_down_and_errors_keep_their_class(server: FakeLLMServer) -> None:
    server.configure(fail_next=2, fail_status=429, retry_after=0.2)
    async with ResourceManager({"vectors": endpoint(server, rate_limit=6000)}) as manager:
        async def with_retries(text: str) -> list[list[float]]:
            for _ in range(10):
                try:
                    return (await manager.embed("vectors", EmbeddingRequest(text))).embeddings
                except RateLimitError:
                    continue
            raise AssertionError("still rate limited")

        vectors = await asyncio.gather(*(with_retries(f"text {i}") for i in range(4)))
        limiter = manager.rate_limiters("vectors")[0]
        assert limiter is not None and limiter.stats.hits == 2
        metrics = manager.metrics("vectors")
        with pytest.raises(ResourceError) as bad:
            await manager.embed("vectors", EmbeddingRequest("[[status:400]]"))
    assert vectors == [[fake_embedding(f"text {i}")] for i in range(4)]
    assert metrics.successes == 4 and metrics.rate_limited == 2 and metrics.input_tokens == 8
    assert bad.value.status == 400 and "marker asked for status 400" in str(bad.value)
    assert server.stats()["by_status"] == {"429": 2, "200": 4, "400": 1}
