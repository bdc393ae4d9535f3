"""The OpenAI server on the jax and tinygrad model runners, with the official ``openai`` client over loopback:
chat completions give the torch framework's greedy tokens, structured outputs hold their schema, and the Batch API
runs lines through the same engine (jobs on the embedded SQLite database)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from api.main import create_app
from app.settings import Settings
from tests.support.server_helpers import ServerThread, build_tiny_llama, make_backend

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-llama"
QUESTIONS = ["hello there", "what is the sea?"]
SCHEMA = {"type": "object", "properties": {"mood": {"type": "string", "enum": ["calm", "stormy"]}},
          "required": ["mood"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("frameworks") / MODEL)


@pytest.fixture(scope="module")
def torch_answers(folder: Path) -> list[str]:
    """The torch framework's greedy answers to QUESTIONS, the reference for the others."""
    from app.engine import LLMEngine, SamplingParams

    engine = LLMEngine(str(folder), dtype="float32", quantization="none", kv_cache_memory_bytes=32 << 20,
                       warmup=False)
    outputs = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                          SamplingParams(temperature=0.0, max_tokens=12))
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module", params=["jax", "tinygrad"])
def served(request: pytest.FixtureRequest, folder: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, openai.OpenAI]]:
    framework = str(request.param)
    pytest.importorskip(framework)
    backend = make_backend("native", folder, framework=framework)
    settings = Settings(data_dir=tmp_path_factory.mktemp(f"state-{framework}"), jobs_poll_interval=0.05)
    server = ServerThread(create_app(settings, backend=backend)).start()
    try:
        yield framework, openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    finally:
        server.stop()


def test_chat_completions_equal_the_torch_framework(served: tuple[str, openai.OpenAI],
                                                     torch_answers: list[str]) -> None:
    framework, client = served
    for question, expected in zip(QUESTIONS, torch_answers, strict=True):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                               temperature=0.0, max_tokens=12)
        assert reply.choices[0].message.content == expected, framework


def test_structured_outputs_hold_their_schema(served: tuple[str, openai.OpenAI]) -> None:
    _, client = served
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the weather?"}], max_tokens=40, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}},
    )
    assert json.loads(reply.choices[0].message.content or "")["mood"] in ("calm", "stormy")


def test_the_batch_api_runs_on_the_framework(served: tuple[str, openai.OpenAI], torch_answers: list[str]) -> None:
    _, client = served
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                       "temperature": 0.0}} for i, q in enumerate(QUESTIONS)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in {"completed", "failed", "cancelled", "expired"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == len(QUESTIONS)
    assert batch.output_file_id is not None
    rows: dict[str, Any] = {}
    for raw in client.files.content(batch.output_file_id).text.splitlines():
        row = json.loads(raw)
        rows[row["custom_id"]] = row["response"]["body"]["choices"][0]["message"]["content"]
    assert [rows[f"q{i}"] for i in range(len(QUESTIONS))] == torch_answers
