"""Tool calls read out of generated text (whole and streamed), the schemas that force them, the tool prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.serving.errors import APIError
from app.serving.schemas import ChatCompletionRequest
from app.serving.tool_calls import ToolCallParser, merge_tool_call_deltas, new_call_id
from app.serving.tool_prompt import (
    TOOL_PROMPT,
    fallback_messages,
    messages_for_template,
    template_supports_tools,
)
from app.serving.tools import combined_structure, forced_schema, plan_tools, structural_tag

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content += text
        calls += new
    text, new = parser.finish()
    return content + text, calls + new


def assert_call(call: dict[str, Any], name: str, arguments: dict[str, Any]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["name"] == name
    assert json.loads(call["function"]["arguments"]) == arguments


# ---------------------------------------------------------------------------------------------- parsing
def test_call_id_shape() -> None:
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("call_") and len(i) == 5 + 24 for i in ids)


def test_auto_parses_calls_and_keeps_the_text_around_them() -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    text += '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    content, calls = ToolCallParser().parse(text)
    assert content == "Sure."
    assert_call(calls[0], "get_weather", {"city": "Paris"})
    assert_call(calls[1], "get_time", {"zone": "utc"})
    assert calls[0]["id"] != calls[1]["id"]


def test_auto_without_calls_is_plain_text() -> None:
    assert ToolCallParser().parse("  no tools needed <tool  ") == ("  no tools needed <tool  ", [])


def test_only_calls_means_null_content() -> None:
    content, calls = ToolCallParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content is None and len(calls) == 1


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_streamed_in_any_split_gives_the_same_result(size: int) -> None:
    text = 'a <tool_call>{"name": "get_weather", "arguments": {"city": "<Oslo>"}}</tool_call> b'
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    content, calls = streamed(ToolCallParser(), pieces)
    assert content == "a  b"
    assert_call(calls[0], "get_weather", {"city": "<Oslo>"})


def test_streaming_holds_back_only_a_possible_tag() -> None:
    p = ToolCallParser()
    assert p.feed("hello <tool") == ("hello ", [])
    assert p.feed("box>") == ("<toolbox>", [])  # not the tag after all: released
    assert p.feed("<tool_call>") == ("", [])
    assert p.feed('{"name": "f", "arguments": {"x": 1}}') == ("", [])
    text, calls = p.feed("</tool_call>")
    assert text == "" and calls[0]["function"]["arguments"] == '{"x":1}'


def test_a_block_that_is_not_a_call_stays_text() -> None:
    text = "x <tool_call>not json</tool_call> y"
    assert ToolCallParser().parse(text) == (text, [])
    cut = 'x <tool_call>{"name": "f", "argum'  # cut by max_tokens
    assert ToolCallParser().parse(cut) == (cut, [])


def test_unterminated_but_complete_call_is_a_call() -> None:
    content, calls = ToolCallParser().parse('<tool_call>{"name": "f", "arguments": {"a": [1]}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": [1]}


def test_arguments_as_json_string_and_parameters_key() -> None:
    _, calls = ToolCallParser().parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2}
    _, calls = ToolCallParser().parse('<tool_call>{"name": "f", "parameters": {"b": 3}}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"b": 3}


def test_parallel_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    _, calls = ToolCallParser(parallel=False).parse(text)
    assert [c["function"]["name"] for c in calls] == ["a"]


def test_forced_named_and_required() -> None:
    content, calls = ToolCallParser("named", "get_weather").parse(' {"city": "Rome"} ')
    assert content is None
    assert_call(calls[0], "get_weather", {"city": "Rome"})
    one = '{"name": "get_time", "arguments": {"zone": "cet"}}'
    assert_call(ToolCallParser("required").parse(one)[1][0], "get_time", {"zone": "cet"})
    many = f'[{one}, {{"name": "get_weather", "arguments": {{"city": "x"}}}}]'
    assert [c["function"]["name"] for c in ToolCallParser("required").parse(many)[1]] == ["get_time", "get_weather"]
    assert len(ToolCallParser("required", parallel=False).parse(many)[1]) == 1


def test_forced_output_that_does_not_parse_is_content() -> None:
    p = ToolCallParser("named", "f")
    assert p.feed('{"a": ') == ("", [])
    assert p.finish() == ('{"a": ', [])
    assert ToolCallParser("required").parse('[{"name": "f"}, 3]') == ('[{"name": "f"}, 3]', [])


def test_merge_streamed_upstream_deltas() -> None:
    calls: list[dict[str, Any]] = []
    merge_tool_call_deltas(calls, [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": '{"a"'}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": ": 1}"}}, {"index": 1, "id": "call_2",
                                   "function": {"name": "g", "arguments": "{}"}}])  # fmt: skip
    assert calls == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


# ---------------------------------------------------------------------------------------------- plans
def test_auto_is_the_default_and_uses_a_structural_tag() -> None:
    plan = plan_tools(chat(tools=TOOLS), upstream=False, constrain=True)
    assert plan is not None and plan.mode == "auto" and plan.structure is not None
    assert plan.structure.param == "tools"
    tag = plan.structure.params.structural_tag
    assert tag == structural_tag(plan.functions)
    assert tag is not None and tag["triggers"] == ["<tool_call>"]
    first = tag["structures"][0]
    assert first == {
        "begin": '<tool_call>{"name": "get_weather", "arguments": ',
        "schema": WEATHER,
        "end": "}</tool_call>",
    }
    # what the tag forces is exactly what the parser reads
    _, calls = ToolCallParser().parse(first["begin"] + '{"city": "x"}' + first["end"])
    assert_call(calls[0], "get_weather", {"city": "x"})
    assert [t["function"]["name"] for t in plan.prompt_tools] == ["get_weather", "get_time"]


def test_forced_schemas() -> None:
    functions = {"get_weather": WEATHER, "get_time": TIME}
    assert forced_schema(functions, "get_time", True) == TIME
    single = forced_schema(functions, None, False)
    assert [o["properties"]["name"]["const"] for o in single["anyOf"]] == ["get_weather", "get_time"]
    assert single["anyOf"][0]["properties"]["arguments"] == WEATHER
    assert single["anyOf"][0]["required"] == ["name", "arguments"]
    parallel = forced_schema(functions, None, True)
    assert parallel == {"type": "array", "items": single, "minItems": 1}
    assert "anyOf" not in forced_schema({"f": WEATHER}, None, False)


def test_forced_plans() -> None:
    named = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       upstream=False, constrain=True)  # fmt: skip
    assert named is not None and named.mode == "named" and named.named == "get_time"
    assert named.structure is not None and named.structure.params.json == TIME
    required = plan_tools(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                          upstream=False, constrain=True)  # fmt: skip
    assert required is not None and required.structure is not None
    assert required.structure.params.json == forced_schema(required.functions, None, False)
    parser = required.parser()
    assert parser is not None and parser.mode == "required" and not parser.parallel


def test_none_and_upstream_plans_neither_constrain_nor_parse() -> None:
    none = plan_tools(chat(tools=TOOLS, tool_choice="none"), upstream=False, constrain=True)
    assert none is not None and none.structure is None and none.parser() is None and none.prompt_tools == []
    up = plan_tools(chat(tools=TOOLS, tool_choice="required"), upstream=True, constrain=True)
    assert up is not None and up.structure is None and up.parser() is None
    assert plan_tools(chat(), upstream=False, constrain=True) is None


def test_auto_without_constraints_still_parses() -> None:
    plan = plan_tools(chat(tools=TOOLS), upstream=False, constrain=False)
    assert plan is not None and plan.structure is None and plan.parser() is not None


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_name_the_field(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        plan_tools(chat(**kw), upstream=False, constrain=True)
    assert err.value.status == 400 and err.value.param == param


def test_forced_call_needs_constraints() -> None:
    with pytest.raises(APIError) as err:
        plan_tools(chat(tools=TOOLS, tool_choice="required"), upstream=False, constrain=False)
    assert err.value.param == "tool_choice" and "native or vllm" in err.value.message


def test_tools_and_response_format_do_not_combine() -> None:
    from app.serving.structured import request_structure

    req = chat(tools=TOOLS, response_format={"type": "json_object"})
    with pytest.raises(APIError) as err:
        combined_structure(plan_tools(req, upstream=False, constrain=True), request_structure(req))
    assert err.value.param == "response_format"
    req = chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    structure = combined_structure(plan_tools(req, upstream=False, constrain=True), request_structure(req))
    assert structure is not None and structure.params.json_object


# ---------------------------------------------------------------------------------------------- prompt
def test_template_support_detection() -> None:
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_supports_tools(None)


HISTORY = [
    {"role": "user", "content": "weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def test_fallback_renders_tools_calls_and_results_as_text() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    out = fallback_messages([{"role": "system", "content": "Be brief."}, *HISTORY], tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(tools[0], separators=(",", ":")) + "\n</tools>" in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>\n'
        '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)
    # no system message: the tool section becomes one
    first = fallback_messages(HISTORY[:1], tools)[0]
    assert first["role"] == "system" and first["content"].startswith("# Tools")
    assert TOOL_PROMPT.splitlines()[0] == "# Tools"


def test_template_with_tools_gets_them_and_object_arguments() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    out, extra = messages_for_template(HISTORY, tools, supports_tools=True)
    assert extra == {"tools": tools}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[2] == HISTORY[2]
    plain, extra = messages_for_template(MSGS, None, supports_tools=False)
    assert plain == MSGS and extra == {}
