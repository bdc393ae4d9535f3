"""The in-process embeddings of the pipeline's clients: the route's body and checks, its answer read back as over
HTTP, its errors in the scheduler's classes; and the jobs' server-backed endpoints that use them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.jobs.endpoints.backend import BackendResourceManager
from app.pipeline import EmbeddingRequest
from app.pipeline.resources import RateLimitError, ResourceError, TransientError
from app.serving.embedding_client import LocalEmbeddings, ServedEmbeddings
from app.serving.errors import APIError, bad_request
from app.serving.schemas import EmbeddingRequest as EmbeddingBody


def _answer(count: int, model: str = "emb") -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": [float(i), 0.5]} for i in range(count)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": 3 * count,
                                                                       "total_tokens": 3 * count}}


async def test_the_route_body_and_its_answer() -> None:
    bodies: list[EmbeddingBody] = []

    async def embed(body: EmbeddingBody) -> dict[str, Any]:
        bodies.append(body)
        return _answer(len(body.input) if isinstance(body.input, list) else 1)

    client = ServedEmbeddings(embed, label="the server", alias="e")
    response = await client.embed(EmbeddingRequest(["a", "b"], dimensions=2, extra_body={"user": "u"}))
    assert response.embeddings == [[0.0, 0.5], [1.0, 0.5]] and response.model == "emb"
    assert response.input_tokens == 6 and response.completion_time_ms is not None
    (body,) = bodies
    assert body.input == ["a", "b"] and body.dimensions == 2 and body.user == "u"
    assert body.encoding_format == "float" and body.model is None  # the server picks its embedding model


@pytest.mark.parametrize(("raised", "kind", "status"), [
    (bad_request("dimensions must be at most 384", "dimensions"), ResourceError, 400),
    (APIError(503, "the embedding model is not loaded yet", type="server_error"), TransientError, 503),
    (APIError(429, "busy"), RateLimitError, 429),
])
async def test_errors_take_the_scheduler_classes(raised: APIError, kind: type, status: int) -> None:
    async def embed(body: EmbeddingBody) -> dict[str, Any]:
        raise raised

    with pytest.raises(kind) as caught:
        await ServedEmbeddings(embed, label="the server", alias="e").embed(EmbeddingRequest("x"))
    error: Any = caught.value
    assert error.status == status and error.alias == "e" and raised.message in str(error)


async def test_a_request_the_route_refuses_and_a_slow_answer() -> None:
    async def slow(body: EmbeddingBody) -> dict[str, Any]:
        await asyncio.sleep(1)
        return _answer(1)

    client = ServedEmbeddings(slow, label="the server", timeout=0.05)
    with pytest.raises(ResourceError, match="invalid request field dimensions") as refused:
        await client.embed(EmbeddingRequest("x", dimensions=0))
    assert refused.value.status == 400
    with pytest.raises(TransientError, match=r"longer than 0\.05s"):
        await client.embed(EmbeddingRequest("x"))


async def test_a_server_without_embeddings_says_how_to_get_them() -> None:
    manager = BackendResourceManager(["batch"], backend=object())
    with pytest.raises(ResourceError, match="--embedding-model all-MiniLM-L6-v2") as caught:
        await manager.embed("batch", EmbeddingRequest("x"))
    assert caught.value.status == 400 and caught.value.alias == "batch"
    assert manager.metrics("batch").failures == 1
    await manager.aclose()


async def test_served_by_the_server_embed_function() -> None:
    async def embed(body: EmbeddingBody) -> dict[str, Any]:
        return _answer(1, model="all-MiniLM-L6-v2")

    manager = BackendResourceManager(["batch"], backend=object(), embed=embed)
    response = await manager.embed("batch", EmbeddingRequest("x"))
    assert response.model == "all-MiniLM-L6-v2" and response.embeddings == [[0.0, 0.5]]
    assert manager.metrics("batch").input_tokens == 3
    await manager.aclose()


def test_local_embeddings_without_a_model_or_a_pooler_have_none() -> None:
    assert LocalEmbeddings().embed_fn(None) is None
    assert LocalEmbeddings(embedding_model="all-MiniLM-L6-v2").embed_fn(None) is not None
