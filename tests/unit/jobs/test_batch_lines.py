"""Batch API input lines: upload checks, the fit to a batch's endpoint, and the job item a line becomes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.jobs.files.batch_lines import (
    MAX_REPORTED_ERRORS,
    BatchFileError,
    check_lines,
    item_of,
    parse_request_lines,
)


def _line(custom_id: str = "a", url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    payload = body or {"messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": payload}


def _file(*lines: Any) -> bytes:
    return "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode()


def test_parses_lines_and_skips_blank_ones() -> None:
    lines = parse_request_lines(_file(_line("a"), "", "   ", _line("b", url="/v1/completions", prompt="p")))
    assert [(r.line, r.custom_id, r.url) for r in lines] == [(1, "a", "/v1/chat/completions"),
                                                             (4, "b", "/v1/completions")]
    assert lines[1].body == {"prompt": "p"}


@pytest.mark.parametrize(
    ("line", "message", "param"),
    [
        ("not json", "line 2 is not valid JSON", None),
        ('"a string"', "not a JSON object", None),
        ({**_line("x"), "custom_id": ""}, "custom_id must be a non-empty string", "custom_id"),
        ({**_line("x"), "custom_id": "y" * 256}, "longer than 255", "custom_id"),
        ({**_line("x"), "method": "PUT"}, "method must be 'POST'", "method"),
        ({**_line("x"), "url": "/v1/responses"}, "url '/v1/responses' is not supported", "url"),
        ({**_line("x"), "body": ["a"]}, "body must be a JSON object", "body"),
        (_line("a"), "duplicate custom_id 'a' (first used on line 1)", "custom_id"),
    ],
)
def test_a_bad_line_names_itself(line: Any, message: str, param: str | None) -> None:
    with pytest.raises(BatchFileError) as caught:
        parse_request_lines(_file(_line("a"), line))
    assert message in caught.value.message and caught.value.line == 2 and caught.value.param == param


def test_empty_and_non_utf8_files() -> None:
    with pytest.raises(BatchFileError, match="no requests"):
        parse_request_lines(b"\n \n")
    with pytest.raises(BatchFileError, match="not UTF-8"):
        parse_request_lines(b"\xc3\x28")


def test_check_lines_against_the_endpoint() -> None:
    lines = parse_request_lines(_file(
        _line("ok"),
        _line("url", url="/v1/completions", prompt="p"),
        _line("empty", messages=[]),
        _line("n", messages=[{"role": "user", "content": "x"}], n=2),
    ))
    problems = check_lines(lines, "/v1/chat/completions")
    assert [(p.code, p.line, p.param) for p in problems] == [
        ("mismatched_endpoint", 2, "url"), ("invalid_request", 3, "body.messages"), ("unsupported_value", 4, "body.n")]
    assert problems[0].as_error() == {"code": "mismatched_endpoint", "message": problems[0].message,
                                      "param": "url", "line": 2}
    completions = parse_request_lines(_file(_line("a", url="/v1/completions", prompt=["one"]),
                                            _line("b", url="/v1/completions", prompt=[1, 2])))
    assert [(p.line, p.param) for p in check_lines(completions, "/v1/completions")] == [(2, "body.prompt")]


def test_reported_problems_are_capped() -> None:
    lines = parse_request_lines(_file(*[_line(str(i), url="/v1/completions", prompt="p") for i in range(150)]))
    assert len(check_lines(lines, "/v1/chat/completions")) == MAX_REPORTED_ERRORS


def test_item_of_a_line() -> None:
    chat = parse_request_lines(_file(_line("c", messages=[{"role": "user", "content": "hi"}], model="gpt",
                                           temperature=0.1, stream=True, max_tokens=5)))[0]
    assert item_of(chat, "/v1/chat/completions") == {
        "custom_id": "c",
        "input": {"messages": [{"role": "user", "content": "hi"}], "options": {"temperature": 0.1, "max_tokens": 5}},
    }
    completion = parse_request_lines(_file(_line("p", url="/v1/completions", prompt=["Once"], seed=3)))[0]
    assert item_of(completion, "/v1/completions")["input"] == {
        "messages": [{"role": "user", "content": "Once"}], "options": {"seed": 3}}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}, "strict": True}}


def test_response_format_and_tools_travel_with_the_line() -> None:
    (chat,) = parse_request_lines(_file(_line("c", messages=[{"role": "user", "content": "hi"}],
                                              response_format=FORMAT, tools=TOOLS, tool_choice="required")))
    assert check_lines([chat], "/v1/chat/completions") == []
    assert item_of(chat, "/v1/chat/completions")["input"]["options"] == {
        "response_format": FORMAT, "tools": TOOLS, "tool_choice": "required"}
    # a completions prompt runs as a chat, where tools would apply: they are a chat completions field
    lines = parse_request_lines(_file(_line("p", url="/v1/completions", prompt="p", response_format=FORMAT),
                                      _line("q", url="/v1/completions", prompt="p", tools=TOOLS)))
    assert [(p.code, p.line, p.param) for p in check_lines(lines, "/v1/completions")] == [
        ("invalid_request", 2, "body.tools")]


def test_output_lines_carry_the_json_and_the_tool_calls() -> None:
    from types import SimpleNamespace

    from app.jobs.batches.service import output_line

    batch = SimpleNamespace(id="batch_1", endpoint="/v1/chat/completions")
    meta = {"model": "m", "finish_reason": "stop", "input_tokens": 3, "output_tokens": 4}
    item = SimpleNamespace(custom_id="a", output={"text": '{"z": "a"}', "meta": meta})
    body = output_line(batch, item, 1)["response"]["body"]  # type: ignore[arg-type]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"z": "a"}'}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = {**meta, "finish_reason": "tool_calls", "tool_calls": [call]}
    item = SimpleNamespace(custom_id="b", output={"text": "", "meta": called})
    (choice,) = output_line(batch, item, 1)["response"]["body"]["choices"]  # type: ignore[arg-type]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert choice["finish_reason"] == "tool_calls"
