"""Structured outputs and tool calls in Batch API lines and jobs, on the server's own engine (the tiny random-weight
Llama on our native engine, on PostgreSQL), through the official ``openai`` client: a line's ``response_format``
is decoded under (its content parses and conforms), a line with ``tools`` and a named ``tool_choice`` answers
with ``tool_calls`` as OpenAI does, and a job of a pipeline with ``LLMInference(response_format=...)`` stores
each record as JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall
from sqlalchemy import Engine

from api.main import create_app
from app.examples.extract import ReviewFacts
from app.settings import Settings
from tests.support.server_helpers import (
    ServerThread,
    build_tiny_llama,
    make_backend,
    native_available,
    with_tools_template,
)

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not native_available(), reason="structured outputs are the native engine's"),
]

KEY = "sk-batch-structured"
FACTS = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "rating"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "facts", "schema": FACTS, "strict": True}}
# The tiny model has 512 positions and about one token per character: small tools only.
F = {"type": "object", "properties": {"z": {"enum": ["a", "b"]}}, "required": ["z"]}
G = {"type": "object", "properties": {"u": {"type": "boolean"}}, "required": ["u"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "f", "parameters": F}},
    {"type": "function", "function": {"name": "g", "parameters": G}},
]


def _line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    payload = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "temperature": 0,
               "max_tokens": 64, **body}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": payload}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("batch-structured")
    return with_tools_template(build_tiny_llama(folder / "plain"), folder / "tiny-llama")


@pytest.fixture
def server(committed: Engine, tiny_model: Path) -> Iterator[ServerThread]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05)  # fmt: skip
    backend = make_backend("native", tiny_model, num_threads=1)
    with ServerThread(create_app(config, backend=backend)) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key=KEY, base_url=server.base_url, max_retries=0, timeout=60) as client:
        yield client


def _run_batch(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in {"completed", "failed", "cancelled", "expired"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    return batch


def _rows(client: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    assert file_id is not None
    rows = [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]
    return {row["custom_id"]: row for row in rows}


def test_batch_lines_with_response_format_and_tools(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "g"}}
    lines = [_line(f"facts-{i}", f"review number {i}: loved it", response_format=FORMAT) for i in range(3)]
    lines.append(_line("call", "is it raining?", tools=TOOLS, tool_choice=named))
    lines.append(_line("required", "pick one", tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    lines.append(_line("both", "x", tools=TOOLS, response_format=FORMAT))  # our engine: one constraint at a time
    done = _run_batch(client, lines)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}

    outputs = _rows(client, done.output_file_id)
    assert set(outputs) == {"facts-0", "facts-1", "facts-2", "call", "required"}
    for i in range(3):
        body = outputs[f"facts-{i}"]["response"]["body"]
        completion = ChatCompletion.model_validate(body)  # the shape the openai client reads
        (choice,) = completion.choices
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert isinstance(choice.message.content, str)
        jsonschema.validate(json.loads(choice.message.content), FACTS)
        assert completion.usage is not None and completion.usage.completion_tokens > 0

    call_body = outputs["call"]["response"]["body"]
    (choice,) = ChatCompletion.model_validate(call_body).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "g"
    jsonschema.validate(json.loads(call.function.arguments), G)
    (required,) = ChatCompletion.model_validate(outputs["required"]["response"]["body"]).choices[0].message.tool_calls or []
    assert isinstance(required, ChatCompletionMessageFunctionToolCall)
    jsonschema.validate(json.loads(required.function.arguments), {"f": F, "g": G}[required.function.name])

    errors = _rows(client, done.error_file_id)
    assert set(errors) == {"both"} and errors["both"]["response"] is None
    assert errors["both"]["error"]["code"] == "resource_error"
    assert "response_format" in errors["both"]["error"]["message"]


def test_a_job_of_a_structured_pipeline_stores_the_records(server: ServerThread) -> None:
    reviews = [{"custom_id": f"r{i}", "input": {"review": f"review {i}: it broke"}} for i in range(3)]
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.root, headers=auth, timeout=60) as http:
        created = http.post("/v1/jobs", json={"pipeline": "review-extract", "inputs": reviews})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        deadline = time.monotonic() + 120
        while (view := http.get(f"/v1/jobs/{job_id}").json())["status"] not in {"completed", "failed"}:
            assert time.monotonic() < deadline, view
            time.sleep(0.1)
        assert view["status"] == "completed" and view["counts"]["completed"] == 3, view
        lines = [json.loads(x) for x in http.get(f"/v1/jobs/{job_id}/results").text.splitlines() if x.strip()]
    assert sorted(line["custom_id"] for line in lines) == ["r0", "r1", "r2"]
    for line in lines:
        assert line["status"] == "completed" and set(line["output"]) == set(ReviewFacts.model_fields), line
        ReviewFacts.model_validate(line["output"])
