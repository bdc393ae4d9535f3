"""/v1/embeddings from the chat model itself (``pooler_config``, vLLM's ``--pooler-config``), with the official
``openai`` client over loopback: LAST and MEAN pooling equal Hugging Face's final hidden states pooled the same
way, in floats and base64, for strings and token ids, and the 400s."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch

from api.main import create_app
from app.settings import Settings
from tests.support.server_helpers import ServerThread, build_tiny_llama, make_backend

pytestmark = pytest.mark.timeout(180)
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import LlamaForCausalLM

    folder = build_tiny_llama(tmp_path_factory.mktemp("pooling") / MODEL)
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), folder


def _serve(folder: Any, pooler: str | None) -> ServerThread:
    backend = make_backend("native", folder, dtype="float32")
    return ServerThread(create_app(Settings(pooler_config=pooler), backend=backend)).start()


@pytest.fixture(scope="module", params=["LAST", "MEAN"])
def served(request: pytest.FixtureRequest, hf_and_folder: tuple[Any, Any]) -> Iterator[tuple[str, Any, Any]]:
    hf, folder = hf_and_folder
    server = _serve(folder, f'{{"pooling_type": "{request.param.lower()}", "normalize": true}}')
    try:
        yield request.param, hf, server
    finally:
        server.stop()


def _reference(hf: Any, ids: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        final = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vector = final[-1] if pooling == "LAST" else final.mean(0)
    return (vector / vector.norm()).numpy()


def test_pooled_embeddings_equal_hugging_face(served: tuple[str, Any, Any]) -> None:
    pooling, hf, server = served
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    batch = [[5, 17, 29, 41], [3, 9, 27, 81, 11, 12], [7]]
    reply = client.embeddings.create(model=MODEL, input=batch)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert reply.usage.prompt_tokens == sum(len(ids) for ids in batch)
    for ids, item in zip(batch, reply.data, strict=True):
        ours = np.array(item.embedding, dtype=np.float32)
        assert len(ours) == hf.config.hidden_size
        assert abs(float(np.linalg.norm(ours)) - 1.0) < 1e-5
        theirs = _reference(hf, ids, pooling)
        assert float(ours @ theirs) >= 0.9999, (pooling, ids)
    packed = client.embeddings.with_raw_response.create(model=MODEL, input=batch[0], encoding_format="base64")
    raw = packed.http_response.json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), reply.data[0].embedding, atol=1e-6)
    text = client.embeddings.create(model=MODEL, input=["hello there", "hi"])
    assert len(text.data) == 2 and text.usage.prompt_tokens > 2


def test_bad_requests(served: tuple[str, Any, Any]) -> None:
    _, hf, server = served
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    with pytest.raises(openai.BadRequestError) as short:
        client.embeddings.create(model=MODEL, input="hello", dimensions=hf.config.hidden_size - 1)
    assert "dimensions" in str(short.value)
    with pytest.raises(openai.BadRequestError) as long:
        client.embeddings.create(model=MODEL, input=[[1] * 100_000])
    assert "input" in str(long.value)


def test_a_chat_model_without_pooling_says_so(hf_and_folder: tuple[Any, Any]) -> None:
    _, folder = hf_and_folder
    server = _serve(folder, None)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=MODEL, input="hello")
        assert "does not pool" in str(refused.value)
    finally:
        server.stop()


def test_a_bad_pooler_config_is_refused() -> None:
    with pytest.raises(ValueError, match="pooling_type"):
        Settings(pooler_config='{"pooling_type": "CLS"}')
    with pytest.raises(ValueError, match="unknown keys"):
        Settings(pooler_config={"pooling": "MEAN"})


async def test_in_process_pooling_without_a_server(hf_and_folder: tuple[Any, Any]) -> None:
    """``inf-engine run`` and engine workers (no server): a pipeline's embeddings come from the in-process chat
    engine's pooling (``pooler_config``), equal to Hugging Face's final hidden states pooled the same way."""
    from app.jobs.endpoints import EndpointResolver
    from app.pipeline import EmbeddingRequest

    hf, folder = hf_and_folder
    settings = Settings(model=str(folder), dtype="float32", num_threads=1,
                        pooler_config='{"pooling_type": "mean", "normalize": true}')
    resolver = EndpointResolver(settings)
    try:
        batch = [[5, 17, 29, 41], [3, 9, 27, 81, 11, 12], [7]]
        response = await resolver(["vectors"]).embed("vectors", EmbeddingRequest(batch))
        assert response.input_tokens == sum(len(ids) for ids in batch)
        for ids, vector in zip(batch, response.embeddings, strict=True):
            ours = np.asarray(vector, dtype=np.float32)
            assert float(ours @ _reference(hf, ids, "MEAN")) >= 0.9999, ids
    finally:
        await resolver.aclose()
