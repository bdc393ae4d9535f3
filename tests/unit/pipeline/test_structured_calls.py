"""Structured outputs and tool calls at the pipeline's seams: what an LLMInference sends (the request, the chat
body every client builds from it), and what it makes of the answer (a validated record, tool calls)."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from app.pipeline import LLMInference, Module, run
from app.pipeline.execution.node_runner import parse_response
from app.pipeline.resources import (
    EndpointConfig,
    LLMRequest,
    LLMResponse,
    OpenAICompatibleClient,
    chat_payload,
)
from app.pipeline.resources.client import response_format_payload
from app.pipeline.values import ValueKind
from tests.support.fakes import ScriptedResources


class Facts(BaseModel):
    sentiment: Literal["positive", "negative"]
    rating: int = Field(ge=1, le=5)


class Lookup(BaseModel):
    """Look a product up by name."""

    name: str


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


# ---------------------------------------------------------------------------------------------- payloads
def test_chat_payload_carries_the_schema_tools_and_choice() -> None:
    request = LLMRequest("hi", system_prompt="s", response_format=Facts, tools=[WEATHER], tool_choice="required")
    body = chat_payload(request)
    assert "model" not in body and body["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
    ]
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "required"
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Facts"
    schema = fmt["json_schema"]["schema"]
    assert schema == Facts.model_json_schema()  # pydantic's schema, as it is (no strict flag: OpenAI's default)
    assert "strict" not in fmt["json_schema"]
    assert set(schema["required"]) == {"sentiment", "rating"}
    # the HTTP client sends the same body, with its model
    http = OpenAICompatibleClient(EndpointConfig("openai", "gpt-x", api_key="k")).build_payload(request)
    assert http == {"model": "gpt-x", **body}


def test_extra_body_wins_and_response_format_shapes() -> None:
    body = chat_payload(LLMRequest("x", tools=[WEATHER], extra_body={"tool_choice": "none", "seed": 3}))
    assert body["tool_choice"] == "none" and body["seed"] == 3
    assert response_format_payload("json") == {"type": "json_object"}
    assert response_format_payload("text") == {"type": "text"}
    generic = response_format_payload(list[int])
    assert generic["json_schema"]["name"] == "list"
    assert generic["json_schema"]["schema"] == {"items": {"type": "integer"}, "type": "array"}
    with pytest.raises(ValueError, match="not understood"):
        response_format_payload("yaml")


def test_the_schema_name_is_one_openai_accepts() -> None:
    name = response_format_payload(dict[str, int])["json_schema"]["name"]
    assert name == "dict"
    odd = type("Odd name!" + "x" * 80, (BaseModel,), {"__annotations__": {"a": int}})
    name = response_format_payload(odd)["json_schema"]["name"]
    assert len(name) == 64 and name.startswith("Odd_name_")


def test_the_http_client_reads_tool_calls() -> None:
    client = OpenAICompatibleClient(EndpointConfig("openai", "gpt-x", api_key="k"))
    message = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    data = {
        "model": "gpt-x",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    raw = json.dumps(data).encode()
    response = client._parse(raw, 1.0)
    assert response.tool_calls == [CALL] and response.content == "" and response.finish_reason == "tool_calls"
    plain = client._parse(b'{"choices": [{"message": {"content": "hi", "tool_calls": []}}]}', 1.0)
    assert plain.tool_calls is None and plain.content == "hi"


# ---------------------------------------------------------------------------------------------- the module
def test_tools_are_normalised_and_choices_checked() -> None:
    llm = LLMInference("fast", tools=[WEATHER, Lookup], tool_choice="Lookup")
    assert llm.tools is not None and llm.tools[0] == WEATHER
    lookup = llm.tools[1]["function"]
    assert lookup["name"] == "Lookup" and lookup["description"] == "Look a product up by name."
    assert lookup["parameters"] == Lookup.model_json_schema()
    assert llm.tool_choice == {"type": "function", "function": {"name": "Lookup"}}
    assert LLMInference("fast", tools=[Lookup], tool_choice=Lookup).tool_choice == llm.tool_choice
    assert LLMInference("fast", tools=[WEATHER], tool_choice="required").tool_choice == "required"
    assert llm.output_kind() is ValueKind.STRUCTURED
    config = llm.node_config()
    assert config["tools"] == llm.tools and config["tool_choice"] == llm.tool_choice
    assert "tools" not in LLMInference("fast").node_config()  # graph hashes of calls without tools unchanged
    with pytest.raises(ValueError, match="name one of the tools"):
        LLMInference("fast", tools=[WEATHER], tool_choice="nope")
    with pytest.raises(ValueError, match="needs tools"):
        LLMInference("fast", tool_choice="get_weather")
    with pytest.raises(ValueError, match=r"tools\[0\] must be an OpenAI function tool"):
        LLMInference("fast", tools=[{"name": "f"}])
    with pytest.raises(ValueError, match="repeat"):
        LLMInference("fast", tools=[WEATHER, WEATHER])


async def test_structured_output_is_the_validated_record() -> None:
    res = ScriptedResources(lambda alias, request: '{"sentiment": "positive", "rating": 4}')
    llm = LLMInference("fast", response_format=Facts)
    out = await run(llm, "great", resources=res)
    assert out == {"sentiment": "positive", "rating": 4}
    assert Facts.model_validate(out) == Facts(sentiment="positive", rating=4)
    (_, request), = res.requests
    assert request.response_format is Facts


async def test_an_invalid_answer_is_a_clear_error() -> None:
    cut = LLMResponse(content='{"sentiment": "posi', finish_reason="length", model="m")
    res = ScriptedResources(lambda alias, request: cut)
    llm = LLMInference("fast", response_format=Facts, max_tokens=5)
    with pytest.raises(Exception, match=r"is not a valid Facts .*cut at max_tokens=5"):
        await run(llm, "x", resources=res)
    res = ScriptedResources(lambda alias, request: '{"sentiment": "meh", "rating": 9}')
    with pytest.raises(Exception, match=r"not a valid Facts \(sentiment: .*rating: Input should be less"):
        await run(LLMInference("fast", response_format=Facts), "x", resources=res)


def test_parse_response_accepts_fences_and_plain_types() -> None:
    assert parse_response('```json\n{"sentiment": "negative", "rating": 1}\n```', Facts) == {
        "sentiment": "negative",
        "rating": 1,
    }
    assert parse_response("[1, 2]", list[int]) == [1, 2]
    with pytest.raises(ValueError, match="is not a valid list"):
        parse_response('["a"]', list[int])


async def test_tool_calls_are_the_output_of_a_call_with_tools() -> None:
    called = LLMResponse(content="", finish_reason="tool_calls", tool_calls=[CALL], model="m")
    res = ScriptedResources(lambda alias, request: called)
    llm = LLMInference("fast", tools=[WEATHER], tool_choice="get_weather")
    assert await run(llm, "weather?", resources=res) == {"content": None, "tool_calls": [CALL]}
    (_, request), = res.requests
    assert request.tools == [WEATHER]
    assert request.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    # a text answer: no calls
    res = ScriptedResources(lambda alias, request: "sunny")
    assert await run(LLMInference("fast", tools=[WEATHER]), "q", resources=res) == {
        "content": "sunny",
        "tool_calls": [],
    }
    # with a response_format too, a text answer is the validated record
    res = ScriptedResources(lambda alias, request: '{"sentiment": "positive", "rating": 2}')
    both = LLMInference("fast", tools=[WEATHER], response_format=Facts)
    assert await run(both, "q", resources=res) == {"content": {"sentiment": "positive", "rating": 2}, "tool_calls": []}


async def test_call_time_tools_and_calls_in_meta() -> None:
    """A plain call given tools at call time (as the Batch API does) keeps its text output; the calls are in
    its meta."""
    import app.pipeline.functional as F

    class Caller(Module):
        def __init__(self) -> None:
            super().__init__()
            self.llm = LLMInference("fast")

        def forward(self, prompt: Any) -> Any:
            response = self.llm(prompt, tools=[WEATHER], tool_choice="auto")
            return {"text": response, "meta": F.extract_meta(response)}

    called = LLMResponse(content="", finish_reason="tool_calls", tool_calls=[CALL], model="m")
    res = ScriptedResources(lambda alias, request: called)
    out: Any = await run(Caller(), "q", resources=res)
    assert out["text"] == "" and out["meta"]["tool_calls"] == [CALL]
    (_, request), = res.requests
    assert request.tools == [WEATHER] and request.tool_choice == "auto"
