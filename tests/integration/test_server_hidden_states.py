"""/v1/activations and interventions on /v1/completions and /v1/chat/completions over HTTP on loopback, the
official ``openai`` client for the completions: captured layers equal Hugging Face's ``output_hidden_states``, an
intervened request in a concurrent batch leaves the others' tokens unchanged, and the 400s name the field."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
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
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any]]:
    from transformers import LlamaForCausalLM

    folder = build_tiny_llama(tmp_path_factory.mktemp("hidden") / MODEL)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    backend = make_backend("native", folder, dtype="float32")
    server = ServerThread(create_app(Settings(), backend=backend)).start()
    try:
        yield server, hf
    finally:
        server.stop()


def post(server: ServerThread, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    return dict(reply.json())


def test_activations_equal_hugging_face(served: tuple[ServerThread, Any]) -> None:
    server, hf = served
    ids = [5, 17, 29, 41, 53, 65, 77]
    layers = list(range(hf.config.num_hidden_layers))
    got = post(server, "/activations", {"model": MODEL, "prompt": ids, "layers": layers, "positions": "all"})
    with torch.no_grad():
        reference = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert got["object"] == "list" and got["positions"] == list(range(len(ids)))
    assert got["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    for entry in got["data"]:
        theirs = reference[entry["layer"] + 1][0]
        ours = torch.tensor(entry["activations"])
        assert entry["shape"] == [len(ids), hf.config.hidden_size]
        assert (ours - theirs).abs().max() <= 1e-4 * max(1.0, float(theirs.abs().max()))
    packed = post(server, "/activations", {"prompt": ids, "layers": [1], "positions": [0, 3],
                                           "encoding_format": "base64"})
    (entry,) = packed["data"]
    rows = np.frombuffer(base64.b64decode(entry["activations"]), dtype="<f4").reshape(entry["shape"])
    assert entry["shape"] == [2, hf.config.hidden_size]
    assert np.allclose(rows, reference[2][0][[0, 3]].numpy(), atol=1e-4)
    last = post(server, "/activations", {"messages": [{"role": "user", "content": "hi"}], "layers": [0]})
    assert last["data"][0]["shape"][0] == 1 and len(last["positions"]) == 1


async def test_an_intervention_leaves_the_rest_of_the_batch_alone(served: tuple[ServerThread, Any]) -> None:
    server, hf = served
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    prompts = [f"story number {i} about" for i in range(6)]
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def one(prompt: str, extra: dict[str, Any] | None = None) -> str:
        body = {**greedy, "extra_body": {**greedy["extra_body"], **(extra or {})}}
        reply = await client.completions.create(prompt=prompt, **body)
        return reply.choices[0].text

    alone = [await one(p) for p in prompts]
    steer = {"interventions": [{"layer": 0, "op": "add", "vector": [4.0] * hf.config.hidden_size}]}
    together = await asyncio.gather(*(one(p, steer if i == 3 else None) for i, p in enumerate(prompts)))
    assert [t for i, t in enumerate(together) if i != 3] == alone[:3] + alone[4:]
    assert together[3] != alone[3]
    chat = await client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], **{**greedy, "extra_body": {
            "ignore_eos": True, "interventions": [{"layer": 1, "op": "zero_heads", "heads": [0, 1]}]}})
    assert chat.choices[0].message.content is not None


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/activations", {"prompt": [5, 6], "layers": [9]}, "layers", "layer 9 is out of range"),
    ("/activations", {"prompt": [5, 6], "layers": [0], "positions": [7]}, "positions", "past the prompt"),
    ("/activations", {"layers": [0]}, "prompt", "exactly one of 'prompt' or 'messages'"),
    ("/activations", {"prompt": [5], "layers": []}, "layers", ""),
    ("/completions", {"prompt": "x", "interventions": [{"layer": 0, "op": "add", "vector": [1.0]}]},
     "interventions", "hidden size"),
    ("/completions", {"prompt": "x", "interventions": [{"layer": 0, "op": "zero_heads", "heads": [99]}]},
     "interventions", "head 99 is out of range"),
    ("/completions", {"prompt": "x", "interventions": [{"layer": 0, "op": "twist"}]}, "interventions", "op must be"),
])
def test_bad_requests_name_the_field(served: tuple[ServerThread, Any], path: str, body: dict[str, Any],
                                     param: str, words: str) -> None:
    error = post(served[0], path, {"model": MODEL, **body}, status=400)["error"]
    assert error["param"] == param and words in error["message"], error
