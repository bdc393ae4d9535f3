"""The /v1/embeddings service with a scripted embedding model: request shapes, encodings, the 400s, and that
concurrent requests are embedded together (counted, not timed)."""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from app.serving.embeddings import EmbeddingService
from app.serving.errors import APIError
from app.serving.schemas import EmbeddingRequest


class ScriptedEmbedder:
    """Each input's vector is [len(ids), sum(ids), first id, 1], normalised; counts its calls."""

    name, dimensions, max_input_tokens, pooling, normalize, vocab_size = "scripted", 4, 8, "mean", True, 1000

    def __init__(self, matryoshka: bool = False) -> None:
        self.matryoshka = matryoshka
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in text][: self.max_input_tokens] for text in texts]

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        self.gate.wait(10)
        self.calls.append(len(inputs))
        rows = torch.tensor([[len(ids), sum(ids), ids[0], 1.0] for ids in inputs], dtype=torch.float32)
        return rows / rows.norm(dim=1, keepdim=True)


def expected(ids: list[int]) -> np.ndarray:
    row = np.array([len(ids), sum(ids), ids[0], 1.0], dtype=np.float32)
    return row / np.linalg.norm(row)


async def service(model: Any) -> EmbeddingService:
    started = EmbeddingService("scripted", loaded=model)
    await started.start()
    return started


async def test_every_input_shape_and_both_encodings() -> None:
    model = ScriptedEmbedder()
    embeddings = await service(model)
    try:
        one = await embeddings.embed(EmbeddingRequest(input="hi"))
        assert one["object"] == "list" and one["model"] == "scripted"
        assert one["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
        assert np.allclose(one["data"][0]["embedding"], expected([104, 105]))
        many = await embeddings.embed(EmbeddingRequest(input=["a", "bcd"], encoding_format="base64"))
        assert [d["index"] for d in many["data"]] == [0, 1]
        decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in many["data"]]
        assert np.allclose(decoded[1], expected([98, 99, 100])) and many["usage"]["prompt_tokens"] == 4
        ids = await embeddings.embed(EmbeddingRequest(input=[5, 6, 7]))
        assert np.allclose(ids["data"][0]["embedding"], expected([5, 6, 7]))  # used as given
        lists = await embeddings.embed(EmbeddingRequest(input=[[5], [6, 7]]))
        assert len(lists["data"]) == 2 and lists["usage"]["total_tokens"] == 3
        same = await embeddings.embed(EmbeddingRequest(input="abc", dimensions=4))
        assert len(same["data"][0]["embedding"]) == 4
    finally:
        await embeddings.stop()


async def test_concurrent_requests_are_embedded_together() -> None:
    model = ScriptedEmbedder()
    embeddings = await service(model)
    try:
        model.gate.clear()  # the first request holds the model while the others queue up
        first = asyncio.create_task(embeddings.embed(EmbeddingRequest(input="x")))
        while not model.calls and embeddings._queue is not None and not embeddings._queue.empty():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(embeddings.embed(EmbeddingRequest(input=f"r{i}"))) for i in range(10)]
        await asyncio.sleep(0.05)
        model.gate.set()
        results = await asyncio.gather(first, *rest)
        assert model.calls == [1, 10]  # one call for the ten that waited
        for i, result in enumerate(results[1:]):
            assert np.allclose(result["data"][0]["embedding"], expected([ord("r"), ord(str(i))]))
    finally:
        await embeddings.stop()


async def test_a_matryoshka_model_shortens_and_renormalises() -> None:
    embeddings = await service(ScriptedEmbedder(matryoshka=True))
    try:
        short = (await embeddings.embed(EmbeddingRequest(input="hi", dimensions=2)))["data"][0]["embedding"]
        full = expected([104, 105])[:2]
        assert np.allclose(short, full / np.linalg.norm(full))
        with pytest.raises(APIError, match="at most 4") as raised:
            await embeddings.embed(EmbeddingRequest(input="hi", dimensions=5))
        assert raised.value.param == "dimensions"
    finally:
        await embeddings.stop()


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "hi", "dimensions": 2}, "dimensions", "cannot shorten them"),
    ({"input": [list(range(3, 12))]}, "input", "input\\[0\\] has 9 tokens; scripted takes at most 8"),
    ({"input": [[3, 4000]]}, "input", "token id 4000; scripted's ids are below 1000"),
])
async def test_input_the_model_cannot_take_is_a_400_naming_the_field(body: dict[str, Any], param: str,
                                                                     message: str) -> None:
    embeddings = await service(ScriptedEmbedder())
    try:
        with pytest.raises(APIError, match=message) as raised:
            await embeddings.embed(EmbeddingRequest(**body))
        assert raised.value.status == 400 and raised.value.param == param
    finally:
        await embeddings.stop()


@pytest.mark.parametrize(("value", "message"), [
    ("", "empty string"), ([], "empty list"), (["a", ""], "input\\[1\\] is empty"), ([[1], []], "input\\[1\\]"),
    (["a"] * 2049, "at most 2048"), ([1.5], "input"), ([-1], "input"),
])
def test_bad_input_shapes_are_refused_by_the_schema(value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EmbeddingRequest(input=value)
    with pytest.raises(ValidationError, match="encoding_format"):
        EmbeddingRequest(input="a", encoding_format="int8")


async def test_the_server_routes_embeddings_by_model_name() -> None:
    from app.serving import OpenAIServing
    from tests.support.serving_fakes import FakeBackend

    backend = FakeBackend()
    chat = backend.served_model_name
    bare = OpenAIServing(backend)
    with pytest.raises(APIError, match="does not pool: this server serves no embedding model") as raised:
        await bare.embed(EmbeddingRequest(input="hi"))
    assert raised.value.status == 400 and raised.value.param == "model"
    embeddings = await service(ScriptedEmbedder())
    serving = OpenAIServing(backend, embeddings=embeddings)
    try:
        ids = [card["id"] for card in (await serving.list_models())["data"]]
        assert ids == [chat, "scripted"]
        assert (await serving.embed(EmbeddingRequest(model="scripted", input="a")))["model"] == "scripted"
        assert (await serving.embed(EmbeddingRequest(input="a")))["model"] == "scripted"  # the only one
        with pytest.raises(APIError, match="generates text and does not pool") as raised:
            await serving.embed(EmbeddingRequest(model=chat, input="a"))
        assert raised.value.status == 400
        with pytest.raises(APIError) as missing:
            await serving.embed(EmbeddingRequest(model="nope", input="a"))
        assert missing.value.status == 404 and missing.value.code == "model_not_found"
        with pytest.raises(APIError, match="is an embedding model: send it to /v1/embeddings"):
            serving.check_model("scripted")
    finally:
        await embeddings.stop()


async def test_the_service_loads_its_model_in_the_dtype_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``INF_ENGINE_EMBEDDING_DTYPE`` reaches the model: ``EmbeddingService(dtype=...)`` loads it so."""
    from app.engine.embedding import EmbeddingModel

    asked: list[str] = []

    def load(spec: str, *, num_threads: int | None = None, dtype: str = "float32") -> Any:
        asked.append(dtype)
        raise RuntimeError("stop here: only the arguments matter")

    monkeypatch.setattr(EmbeddingModel, "load", load)
    for dtype in ("bfloat16", "float32"):
        with pytest.raises(RuntimeError, match="stop here"):
            await EmbeddingService("all-MiniLM-L6-v2", dtype=dtype).start()
    assert asked == ["bfloat16", "float32"]
