"""The in-process client takes the route's path for ``response_format`` and tools: the output is decoded under
the schema (or the call's structure), tool calls come back in the ``LLMResponse``, and what the route refuses
is refused here, naming the field. On the tiny random-weight Llama: its words are noise, its shapes must hold."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field

from app.pipeline import LLMInference, ResourceManager, run
from app.pipeline.resources import EndpointConfig, LLMRequest, ResourceError, register_client_factory
from app.serving.embedded import (
    EmbeddedEngine,
    EmbeddedEngineClient,
    embedded_resources,
    get_embedded_engine,
    register_embedded_engine,
)
from tests.support.server_helpers import build_tiny_llama, with_tools_template

pytestmark = pytest.mark.timeout(180)

ENGINE_OPTIONS = {"warmup": False, "kv_cache_memory_bytes": 16 << 20, "seed": 0}
# The tiny model has 512 positions and about one token per character: small tools only.
F = {"type": "object", "properties": {"z": {"enum": ["a", "b"]}}, "required": ["z"]}
G = {"type": "object", "properties": {"u": {"type": "boolean"}}, "required": ["u"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "f", "parameters": F}},
    {"type": "function", "function": {"name": "g", "parameters": G}},
]


class Facts(BaseModel):
    sentiment: Literal["positive", "negative", "mixed"]
    rating: int = Field(ge=1, le=5)
    recommended: bool


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with a compact tools-aware chat template (its positions are few)."""
    folder = tmp_path_factory.mktemp("embedded-structured")
    return str(with_tools_template(build_tiny_llama(folder / "plain"), folder / "tiny-llama"))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
async def client(tiny_model: str) -> AsyncIterator[EmbeddedEngineClient]:
    engine: EmbeddedEngine = get_embedded_engine(tiny_model, **ENGINE_OPTIONS)
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    try:
        yield client
    finally:
        await client.aclose()


def ask(**kwargs: Any) -> LLMRequest:
    return LLMRequest("hi", **{"temperature": 0.0, "max_tokens": 64, **kwargs})


async def test_response_format_is_decoded_under_the_schema(client: EmbeddedEngineClient) -> None:
    response = await client.complete(ask(response_format=Facts))
    assert response.finish_reason == "stop" and response.tool_calls is None
    Facts.model_validate_json(response.content)
    loose = await client.complete(ask(response_format="json", max_tokens=300))
    if loose.finish_reason == "stop":  # a random model may write a long object; what it finishes must parse
        assert isinstance(json.loads(loose.content), dict)


async def test_tool_calls_come_back_in_the_response(client: EmbeddedEngineClient) -> None:
    named = await client.complete(ask(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}))
    (call,) = named.tool_calls or []
    assert named.finish_reason == "tool_calls" and named.content == ""
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "g"
    jsonschema.validate(json.loads(call["function"]["arguments"]), G)
    required = await client.complete(ask(tools=TOOLS, tool_choice="required", extra_body={"parallel_tool_calls": False}))
    (call,) = required.tool_calls or []
    jsonschema.validate(json.loads(call["function"]["arguments"]), {"f": F, "g": G}[call["function"]["name"]])
    none = await client.complete(ask(tools=TOOLS, tool_choice="none", max_tokens=4))
    assert none.tool_calls is None and none.finish_reason in ("stop", "length")


async def test_what_the_route_refuses_is_refused_naming_the_field(client: EmbeddedEngineClient) -> None:
    with pytest.raises(ResourceError, match=r"tool_choice.*not in 'tools'") as bad:
        await client.complete(ask(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}))
    assert bad.value.status == 400
    with pytest.raises(ResourceError, match=r"\(response_format\).*cannot be combined with tools") as bad:
        await client.complete(ask(tools=TOOLS, response_format=Facts))
    assert bad.value.status == 400
    with pytest.raises(ResourceError, match=r"response_format\.json_schema\.schema.*not a valid JSON schema"):
        await client.complete(ask(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "nonsense"}}}))  # fmt: skip


async def test_a_structured_pipeline_returns_records_and_calls(tiny_model: str) -> None:
    previous = register_client_factory("native", None)
    register_embedded_engine(**ENGINE_OPTIONS)
    manager = ResourceManager(embedded_resources(["assistant"], tiny_model))
    try:
        record = await run(LLMInference("assistant", temperature=0.0, max_tokens=64, response_format=Facts), "hi",
                           resources=manager)  # fmt: skip
        assert isinstance(record, dict) and Facts.model_validate(record)
        caller = LLMInference("assistant", temperature=0.0, max_tokens=64, tools=TOOLS, tool_choice="f")
        answer: Any = await run(caller, "hi", resources=manager)
        assert answer["content"] is None
        (call,) = answer["tool_calls"]
        assert call["function"]["name"] == "f"
        jsonschema.validate(json.loads(call["function"]["arguments"]), F)
    finally:
        await manager.aclose()
        register_client_factory("native", previous)
