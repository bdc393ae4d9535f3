"""Structured outputs and tool calling through the real ``openai`` client, against servers on 127.0.0.1.

Three servers: one over a scripted backend (it "generates" what a test scripts, so the server's part — field
mapping, tool-call parsing, response and stream shapes, errors — is checked exactly), an OpenAI proxy in
front of that one (fields forwarded, upstream tool calls passed through), and one over the tiny random Llama
on our engine, where the constraint itself must hold: outputs parse and conform to their schemas (a probe with
a ``choice`` constraint fails first if the engine does not enforce them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from api.main import create_app
from app.serving.backends.base import Backend, GenerationRequest
from app.serving.backends.openai_proxy import OpenAIProxyBackend
from app.settings import Settings
from tests.support.server_helpers import (
    ServerThread,
    build_tiny_llama,
    make_backend,
    native_available,
    with_tools_template,
)
from tests.support.serving_fakes import FakeBackend, default_reply

pytestmark = pytest.mark.timeout(180)

KEY = "sk-test-key"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'


def validate(instance: Any, schema: dict[str, Any]) -> None:
    """JSON Schema validation with whichever library is installed (jsonschema, else schemathesis' jsonschema_rs)."""
    try:
        import jsonschema
    except ImportError:
        import jsonschema_rs

        jsonschema_rs.validate(schema, instance)
    else:
        jsonschema.validate(instance, schema)


def assert_call_shape(call: Any) -> None:
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-zA-Z]{24}", call.id), call
    assert isinstance(call.function.name, str) and isinstance(call.function.arguments, str)
    json.loads(call.function.arguments)


def accumulate(chunks: list[Any]) -> tuple[str, dict[int, dict[str, Any]], str | None]:
    """Content, tool calls by index and finish reason of a streamed chat, the way clients accumulate them."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "type": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["type"] = tc.type or call["type"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


# ---------------------------------------------------------------------------------------------- scripted
class ScriptedBackend(FakeBackend):
    """Replies with the scripted texts in turn (then echoes), and says it honours structured outputs."""

    supports_structured_outputs = True

    def __init__(self) -> None:
        super().__init__(self._next)
        self.script: list[str] = []

    def _next(self, request: GenerationRequest, index: int) -> str:
        return self.script.pop(0) if self.script else default_reply(request, index)


@pytest.fixture(scope="module")
def scripted() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture(scope="module")
def fake_server(scripted: ScriptedBackend) -> Iterator[ServerThread]:
    with ServerThread(create_app(Settings(api_keys=[KEY]), backend=scripted)) as srv:
        yield srv


@pytest.fixture(scope="module")
def fake(fake_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.base_url, api_key=KEY, max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(**{"model": "fake-model", "messages": MSGS, **kw})


def test_json_schema_strict(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = ['{"city": "Paris", "unit": "celsius"}']
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    resp = chat(fake, response_format=fmt)
    validate(json.loads(resp.choices[0].message.content), WEATHER)
    sent = scripted.requests[-1]
    assert sent.params.structured_outputs is not None and sent.params.structured_outputs.json == WEATHER
    assert sent.structured_param == "response_format"


def test_json_object_and_streamed(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = ['{"a": [1, 2]}']
    stream = chat(fake, response_format={"type": "json_object"}, stream=True)
    content, calls, reason = accumulate(list(stream))
    assert json.loads(content) == {"a": [1, 2]} and not calls and reason == "stop"
    assert scripted.requests[-1].params.structured_outputs.json_object  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, "grammar", 'root ::= "yes" | "no"'),
        ({"structured_outputs": {"json": WEATHER}}, "json", WEATHER),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'root ::= "yes"'}, "grammar", 'root ::= "yes"'),
        ({"guided_json": WEATHER}, "json", WEATHER),
    ],
)
def test_vllm_fields_on_both_endpoints(
    fake: openai.OpenAI, scripted: ScriptedBackend, extra: dict[str, Any], field: str, value: Any
) -> None:
    chat(fake, extra_body=extra, max_tokens=5)
    assert getattr(scripted.requests[-1].params.structured_outputs, field) == value
    fake.completions.create(model="fake-model", prompt="x", extra_body=extra, max_tokens=5)
    assert getattr(scripted.requests[-1].params.structured_outputs, field) == value
    stream = fake.completions.create(model="fake-model", prompt="x", extra_body=extra, max_tokens=5, stream=True)
    assert [c for c in stream]
    assert getattr(scripted.requests[-1].params.structured_outputs, field) == value


def test_auto_tool_call_from_generated_text(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = ["Checking. " + CALL]
    resp = chat(fake, tools=TOOLS)
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert_call_shape(call)
    assert call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), WEATHER)
    sent = scripted.requests[-1]
    assert sent.tools is not None and [t["function"]["name"] for t in sent.tools] == ["get_weather", "get_time"]
    tag = sent.params.structured_outputs.structural_tag  # type: ignore[union-attr]
    assert tag is not None and tag["triggers"] == ["<tool_call>"] and len(tag["structures"]) == 2


def test_auto_tool_call_streamed(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = [CALL + "\n" + CALL.replace("get_weather", "get_time").replace(
        '{"city": "Paris", "unit": "celsius"}', '{"zone": "utc"}')]  # fmt: skip
    content, calls, reason = accumulate(list(chat(fake, tools=TOOLS, stream=True)))
    assert content == "" and reason == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls.values())
    assert json.loads(calls[1]["arguments"]) == {"zone": "utc"}


def test_auto_without_a_call_is_plain_text(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = ["It is sunny."]
    (choice,) = chat(fake, tools=TOOLS).choices
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_forced_calls(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = ['{"city": "Oslo", "unit": "fahrenheit"}']
    named = {"type": "function", "function": {"name": "get_weather"}}
    (choice,) = chat(fake, tools=TOOLS, tool_choice=named).choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert_call_shape(call)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Oslo"
    assert scripted.requests[-1].params.structured_outputs.json == WEATHER  # type: ignore[union-attr]

    scripted.script = ['[{"name": "get_time", "arguments": {"zone": "cet"}}, '
                       '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]']  # fmt: skip
    content, calls, reason = accumulate(list(chat(fake, tools=TOOLS, tool_choice="required", stream=True)))
    assert content == "" and reason == "tool_calls"
    assert [calls[0]["name"], calls[1]["name"]] == ["get_time", "get_weather"]
    validate(json.loads(calls[1]["arguments"]), WEATHER)
    schema = scripted.requests[-1].params.structured_outputs.json  # type: ignore[union-attr]
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1


def test_tool_result_round_trip(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    scripted.script = [CALL]
    first = chat(fake, tools=TOOLS).choices[0].message
    history: list[Any] = [
        *MSGS,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 degrees and sunny"},
    ]
    scripted.script = ["It is 18 degrees and sunny in Paris."]
    (choice,) = chat(fake, messages=history, tools=TOOLS).choices
    assert choice.message.content == "It is 18 degrees and sunny in Paris." and choice.finish_reason == "stop"
    sent = scripted.requests[-1].messages
    assert sent is not None and sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[1]["content"] is None and sent[2]["tool_call_id"] == first.tool_calls[0].id


def test_errors_name_the_field(fake: openai.OpenAI) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": bad_schema}, "response_format.json_schema.schema"),
        ({"extra_body": {"guided_json": {"properties": 3}}}, "guided_json"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
    ]  # fmt: skip
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            chat(fake, **kw)
        assert bad.value.body["param"] == param, (kw, bad.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        fake.completions.create(model="fake-model", prompt="x", suffix="tail")
    assert bad.value.body["param"] == "suffix"  # type: ignore[index]
    # a truly unknown field is ignored
    assert chat(fake, extra_body={"some_future_field": 1}).choices


def test_best_of_reaches_the_params(fake: openai.OpenAI, scripted: ScriptedBackend) -> None:
    fake.completions.create(model="fake-model", prompt="x", best_of=3, max_tokens=2)
    assert scripted.requests[-1].params.best_of == 3


def test_proxy_forwards_fields_and_passes_tool_calls_through(
    fake_server: ServerThread, scripted: ScriptedBackend
) -> None:
    proxy = OpenAIProxyBackend(base_url=fake_server.base_url, api_key=KEY, served_model_name="proxied")
    with ServerThread(create_app(Settings(), backend=proxy)) as front_srv:
        front = openai.OpenAI(base_url=front_srv.base_url, api_key="x", max_retries=0, timeout=60)
        scripted.script = ["Sure. " + CALL]
        (choice,) = chat(front, model="proxied", tools=TOOLS, tool_choice="auto").choices
        # the upstream streams "Sure. " before it knows a call follows; the proxy keeps its text as sent
        assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "Sure."
        assert_call_shape(choice.message.tool_calls[0])
        assert scripted.requests[-1].tools is not None  # the upstream rendered the tools itself
        scripted.script = [CALL]
        content, calls, reason = accumulate(list(chat(front, model="proxied", tools=TOOLS, stream=True)))
        assert reason == "tool_calls" and calls[0]["name"] == "get_weather" and not content
        scripted.script = ['{"city": "Paris", "unit": "celsius"}']
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
        resp = chat(front, model="proxied", response_format=fmt)
        validate(json.loads(resp.choices[0].message.content), WEATHER)
        assert scripted.requests[-1].params.structured_outputs.json == WEATHER  # type: ignore[union-attr]
        chat(front, model="proxied", extra_body={"guided_choice": ["a", "b"]})
        assert scripted.requests[-1].params.structured_outputs.choice == ["a", "b"]  # type: ignore[union-attr]


def test_a_backend_without_structured_outputs_says_so() -> None:
    with ServerThread(create_app(Settings(), backend=FakeBackend())) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as bad:
            chat(client, response_format={"type": "json_object"})
        assert bad.value.body["param"] == "response_format"  # type: ignore[index]
        assert "native or vllm" in bad.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as forced:
            chat(client, tools=TOOLS, tool_choice="required")
        assert forced.value.body["param"] == "tool_choice"  # type: ignore[index]
        assert chat(client, tools=TOOLS).choices[0].message.content  # auto: parsed, unconstrained


# ---------------------------------------------------------------------------------------------- real model
KIND = "native" if native_available() else "transformers"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")  # shared by test_server_* modules


@pytest.fixture(scope="module")
def engine_backend(tiny_llama: Path) -> Backend:
    return make_backend(KIND, tiny_llama)


@pytest.fixture(scope="module")
def engine(engine_backend: Backend) -> Iterator[openai.OpenAI]:
    with ServerThread(create_app(Settings(api_keys=[KEY]), backend=engine_backend)) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=120)


def greedy(client: openai.OpenAI, **kw: Any) -> Any:
    return chat(client, **{"model": "tiny-llama", "messages": SHORT, "temperature": 0, "max_tokens": 64, **kw})


# The tiny model has 512 positions and a tokenizer of about one token per character: small tools only.
SHORT = [{"role": "user", "content": "hi"}]
F = {"type": "object", "properties": {"z": {"enum": ["a", "b"]}}, "required": ["z"]}
G = {"type": "object", "properties": {"u": {"type": "boolean"}}, "required": ["u"]}
TINY_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "f", "parameters": F}},
    {"type": "function", "function": {"name": "g", "parameters": G}},
]
TINY_SCHEMAS = {"f": F, "g": G}


@pytest.fixture(scope="module")
def tools_backend(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    # a tools-aware chat template (compact: the tool names only), on a copy of the tiny model
    return make_backend(KIND, with_tools_template(tiny_llama, tmp_path_factory.mktemp("tools-llama") / "tiny-llama"))


@pytest.fixture(scope="module")
def tool_engine(tools_backend: Backend, enforced: openai.OpenAI) -> Iterator[openai.OpenAI]:
    with ServerThread(create_app(Settings(api_keys=[KEY]), backend=tools_backend)) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def enforced(engine: openai.OpenAI) -> openai.OpenAI:
    """The engine client, once a ``choice`` constraint is seen to hold: a refusal or an unconstrained answer fails."""
    if KIND != "native":
        pytest.skip("structured outputs are the native engine's")
    try:
        out = greedy(engine, max_tokens=4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    except openai.BadRequestError as exc:
        pytest.fail(f"the engine refuses structured outputs: {exc}")
    assert out.choices[0].message.content in ("yes", "no"), "the engine does not enforce structured outputs"
    return engine


def test_engine_json_schema_conforms(enforced: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": TIME, "strict": True}}
    resp = greedy(enforced, response_format=fmt, max_tokens=100)
    validate(json.loads(resp.choices[0].message.content), TIME)
    content, _, _ = accumulate(list(greedy(enforced, response_format=fmt, max_tokens=100, stream=True)))
    assert content == resp.choices[0].message.content  # streamed = whole


def test_engine_json_object(enforced: openai.OpenAI) -> None:
    (choice,) = greedy(enforced, response_format={"type": "json_object"}, max_tokens=300).choices
    if choice.finish_reason == "stop":  # a random model may write a long object; what it finishes must parse
        assert isinstance(json.loads(choice.message.content), dict)


def test_engine_regex_choice_grammar_and_aliases(enforced: openai.OpenAI) -> None:
    regex = greedy(enforced, max_tokens=8, extra_body={"structured_outputs": {"regex": "(ab|cd){2}"}})
    assert re.fullmatch("(ab|cd){2}", regex.choices[0].message.content)
    choice = greedy(enforced, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].message.content in ("red", "green", "blue")
    grammar = greedy(enforced, extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe"'}})
    assert grammar.choices[0].message.content in ("yes", "no", "maybe")
    completion = enforced.completions.create(model="tiny-llama", prompt="the fox", max_tokens=8, temperature=0,
                                             extra_body={"guided_regex": "[0-9]{3}"})  # fmt: skip
    assert re.fullmatch("[0-9]{3}", completion.choices[0].text)
    stream = enforced.completions.create(model="tiny-llama", prompt="the fox", max_tokens=8, temperature=0,
                                         stream=True, extra_body={"guided_regex": "[0-9]{3}"})  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == completion.choices[0].text


def test_engine_forced_tool_calls_conform(tool_engine: openai.OpenAI) -> None:
    enforced = tool_engine
    named = {"type": "function", "function": {"name": "f"}}
    (choice,) = greedy(enforced, tools=TINY_TOOLS, tool_choice=named).choices
    (call,) = choice.message.tool_calls
    assert_call_shape(call)
    assert call.function.name == "f" and choice.finish_reason == "tool_calls" and choice.message.content is None
    validate(json.loads(call.function.arguments), F)
    resp = greedy(enforced, tools=TINY_TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = resp.choices[0].message.tool_calls
    assert_call_shape(call)
    validate(json.loads(call.function.arguments), TINY_SCHEMAS[call.function.name])
    chunks = list(greedy(enforced, tools=TINY_TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True))
    _, calls, reason = accumulate(chunks)
    assert reason == resp.choices[0].finish_reason == "tool_calls" and calls[0]["name"] == call.function.name
    assert calls[0]["arguments"] == call.function.arguments  # streamed = whole (greedy)


def test_engine_auto_tool_choice_has_a_valid_shape(tool_engine: openai.OpenAI) -> None:
    enforced = tool_engine
    (choice,) = greedy(enforced, tools=TINY_TOOLS).choices
    calls = choice.message.tool_calls or []
    for call in calls:
        assert_call_shape(call)
        validate(json.loads(call.function.arguments), TINY_SCHEMAS[call.function.name])
    assert choice.finish_reason == ("tool_calls" if calls else choice.finish_reason)
    assert choice.finish_reason in ("tool_calls", "stop", "length")
    assert calls or isinstance(choice.message.content, str)
    _, streamed, reason = accumulate(list(greedy(enforced, tools=TINY_TOOLS, stream=True)))
    assert [c["name"] for c in streamed.values()] == [c.function.name for c in calls]  # greedy: the same choice
    assert reason == choice.finish_reason


def test_engine_tool_round_trip_and_fallback_prompt(engine: openai.OpenAI, engine_backend: Backend) -> None:
    history: list[Any] = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_" + "a" * 24, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_" + "a" * 24, "content": "18 degrees"},
    ]  # fmt: skip
    resp = greedy(engine, messages=history, tools=TINY_TOOLS, tool_choice="none", max_tokens=8,
                  extra_body={"ignore_eos": True})  # fmt: skip
    (choice,) = resp.choices
    assert isinstance(choice.message.content, str) and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    # the tiny model's template knows no tools: the fallback renders the history (and tools) as text
    prompt = engine_backend._render_chat(history, True, [TOOLS[0]])  # type: ignore[attr-defined]
    assert "# Tools" in prompt and '"name":"get_weather"' in prompt
    assert '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}</tool_call>' in prompt
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt


def test_engine_invalid_schema_is_a_400(engine: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        greedy(engine, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}})
    assert bad.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


def test_a_tools_aware_template_gets_tools_and_object_arguments(tools_backend: Backend, tool_engine: Any) -> None:
    history = [*SHORT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"z": "a"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]  # fmt: skip
    prompt = tools_backend._render_chat(history, True, TINY_TOOLS)  # type: ignore[attr-defined]
    assert prompt.startswith("<|im_start|>system\ntools: f g<|im_end|>")
    assert '<call>f {"z": "a"}</call>' in prompt and "<|im_start|>tool\ndone<|im_end|>" in prompt
    assert "# Tools" not in prompt


def test_engine_compile_errors_name_the_field(enforced: openai.OpenAI) -> None:
    """What only the grammar compiler refuses (add_request's ValueError) is a 400 naming the field sent."""
    for extra, param in (
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            greedy(enforced, extra_body=extra)
        assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]


async def test_a_pipeline_gets_records_and_tool_calls_over_http(tool_engine: openai.OpenAI) -> None:
    """LLMInference against our server through the pipeline's HTTP client (as for vLLM and OpenAI): the schema and
    the tools go out, a validated record and OpenAI's tool calls come back."""
    from typing import Literal

    from pydantic import BaseModel

    from app.pipeline import EndpointConfig, LLMInference, ResourceConfig, run

    class Pick(BaseModel):
        z: Literal["a", "b"]

    url = str(tool_engine.base_url).rstrip("/")
    resources = ResourceConfig({"m": EndpointConfig("native", "tiny-llama", base_url=url, api_key=KEY)})
    record = await run(LLMInference("m", temperature=0.0, max_tokens=32, response_format=Pick), "hi",
                       resources=resources)  # fmt: skip
    assert Pick.model_validate(record) and set(record) == {"z"}
    caller = LLMInference("m", temperature=0.0, max_tokens=64, tools=TINY_TOOLS, tool_choice="g")
    answer: Any = await run(caller, "hi", resources=resources)
    (call,) = answer["tool_calls"]
    assert answer["content"] is None and call["function"]["name"] == "g" and call["id"].startswith("call_")
    validate(json.loads(call["function"]["arguments"]), G)
