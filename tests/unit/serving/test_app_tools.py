"""Tools and structured outputs through the HTTP API on scripted backends: shapes per choice, message checks,
logged unknown fields, and what a proxy backend sends upstream."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from app.serving.backends.base import GenerationRequest
from app.serving.backends.openai_proxy import OpenAIProxyBackend
from app.settings import Settings
from tests.support.serving_fakes import FakeBackend

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "f", "arguments": {"i": %d}}</tool_call>'


class StructuredFake(FakeBackend):
    supports_structured_outputs = True


def replies(request: GenerationRequest, index: int) -> str:
    return "plain answer" if index == 0 else "calling " + CALL % index


@pytest.fixture
def backend() -> StructuredFake:
    return StructuredFake(replies)


@pytest.fixture
def client(backend: StructuredFake) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(), backend=backend)) as c:
        yield c


def events(response: Any) -> list[dict[str, Any]]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_each_choice_is_parsed_on_its_own(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "n": 2}).json()
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "plain answer"} and first["finish_reason"] == "stop"
    assert second["message"]["content"] == "calling" and second["finish_reason"] == "tool_calls"
    (call,) = second["message"]["tool_calls"]
    assert set(call) == {"id", "type", "function"} and call["function"] == {"name": "f", "arguments": '{"i":1}'}


def test_streamed_choices_keep_their_own_call_indexes(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "n": 2, "stream": True})
    chunks = events(r)
    deltas = [(c["index"], c["delta"], c["finish_reason"]) for e in chunks for c in e["choices"]]
    calls = [(i, d["tool_calls"]) for i, d, _ in deltas if "tool_calls" in d]
    assert [(i, [c["index"] for c in tc]) for i, tc in calls] == [(1, [0])]
    (call,) = calls[0][1]
    assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] == "f"
    finishes = {i: reason for i, _, reason in deltas if reason}
    assert finishes == {0: "stop", 1: "tool_calls"}
    text = {i: "".join(d.get("content") or "" for j, d, _ in deltas if j == i) for i in (0, 1)}
    assert text == {0: "plain answer", 1: "calling "}


def test_tool_choice_none_leaves_text_and_prompt_alone(client: TestClient, backend: StructuredFake) -> None:
    body = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none",
                                                     "n": 2}).json()  # fmt: skip
    assert body["choices"][1]["message"]["content"] == "calling " + CALL % 1
    sent = backend.requests[-1]
    assert sent.tools is None and sent.params.structured_outputs is None


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "function", "name": "f", "content": "x"}, "messages[1].role"),
        ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f"}}]}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "f"}}]},
         "messages[1].tool_calls[0].type"),
    ],
)  # fmt: skip
def test_bad_tool_messages_name_the_field(client: TestClient, message: dict[str, Any], param: str) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [*MSGS, message]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_history_is_passed_on_with_calls_and_ids(client: TestClient, backend: StructuredFake) -> None:
    history = [
        *MSGS,
        {"role": "assistant", "tool_calls": [{"id": "call_x", "type": "function",
                                              "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": [{"type": "text", "text": "42"}]},
    ]  # fmt: skip
    assert client.post("/v1/chat/completions", json={"messages": history}).status_code == 200
    sent = backend.requests[-1].messages
    assert sent is not None
    assert sent[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}  # fmt: skip
    assert sent[2] == {"role": "tool", "content": "42", "tool_call_id": "call_x"}
    tokens = client.post("/tokenize", json={"messages": history}).json()
    assert tokens["count"] > 0


def test_unknown_fields_are_logged_and_ignored(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="app.serving.params"):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": 1, "zz": 2})
    assert r.status_code == 200
    assert any("frobnicate, zz" in rec.getMessage() for rec in caplog.records)


def test_structured_completions_stream(client: TestClient, backend: StructuredFake) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 3,
                                             "response_format": {"type": "json_object"}})  # fmt: skip
    assert r.status_code == 200 and events(r)
    assert backend.requests[-1].params.structured_outputs == StructuredOutputsParams(json_object=True)
    assert backend.requests[-1].structured_param == "response_format"


def test_proxy_payload_forwards_fields_as_sent() -> None:
    proxy = OpenAIProxyBackend(base_url="http://h/v1", upstream_model="up")
    fields = {
        "response_format": {"type": "json_object"},
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "guided_decoding_backend": "xgrammar",
    }
    request = GenerationRequest("r", SamplingParams(), messages=MSGS, upstream_fields=fields)
    path, body = proxy.payload(request)
    assert path == "/chat/completions" and {k: body[k] for k in fields} == fields
    params = SamplingParams(n=2, best_of=3, structured_outputs=StructuredOutputsParams(regex="a"))
    path, body = proxy.payload(GenerationRequest("r", params, prompt="x",
                                                 upstream_fields={"guided_regex": "a"}))  # fmt: skip
    assert path == "/completions" and body["best_of"] == 3 and body["guided_regex"] == "a"
    assert "structured_outputs" not in body  # the client's own spelling goes upstream, not ours


async def test_the_transformers_backend_refuses_constraints_and_best_of() -> None:
    from app.serving.backends.base import InvalidRequestError
    from app.serving.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend()
    backend._executor, backend.hf_model = object(), object()  # type: ignore[assignment]  # "started"
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(InvalidRequestError) as err:
        await backend.generate(GenerationRequest("r", structured, prompt="x", structured_param="guided_choice"))
    assert err.value.param == "guided_choice" and "native or vllm" in err.value.message
    with pytest.raises(InvalidRequestError) as best:
        await backend.generate(GenerationRequest("r", SamplingParams(best_of=2), prompt="x"))
    assert best.value.param == "best_of"
