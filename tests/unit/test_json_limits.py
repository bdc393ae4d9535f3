"""app.json_limits: the depth, integer and Unicode limits of accepted JSON, and where a problem is."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.json_limits import INT_MAX, INT_MIN, MAX_JSON_DEPTH, JSONLimitError, json_problem, loads


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_depth_is_exact_and_never_recursed() -> None:
    assert json_problem(nested(MAX_JSON_DEPTH)) is None
    assert json_problem({"a": nested(MAX_JSON_DEPTH - 1)}) is None
    problem = json_problem({"ok": 1, "deep": nested(MAX_JSON_DEPTH)})
    assert problem is not None and problem.kind == "json_too_deep" and problem.loc == ("deep",)
    assert json_problem(nested(100_000)) is not None  # far past Python's recursion limit: no RecursionError
    assert json_problem("text") is None and json_problem(None) is None


@pytest.mark.parametrize("number", [INT_MAX + 1, INT_MIN - 1, 2**70])
def test_integers_must_fit_in_64_bits(number: int) -> None:
    assert json_problem([INT_MIN, INT_MAX, True, 1.5e300]) is None
    problem = json_problem({"a": [1, {"b": number}]})
    assert problem is not None and problem.kind == "json_integer_too_large" and problem.loc == ("a", 1, "b")
    assert json_problem(number) is not None


def test_lone_surrogates_are_not_text() -> None:
    assert json_problem(json.loads('{"emoji": "\\ud83d\\ude00"}')) is None  # a pair is one character
    for text, loc in (('{"a": ["x", "\\ud800"]}', ("a", 1)), ('{"k\\udfff": 1}', ("k\\udfff",)), ('"\\udc00"', ())):
        problem = json_problem(json.loads(text))
        assert problem is not None and problem.kind == "json_invalid_unicode" and problem.loc == loc, text
    assert json_problem({1: "a"}) is None  # a dict built in Python may have other keys


def test_loads() -> None:
    assert loads('{"a": [1, 2]}') == {"a": [1, 2]}
    for text in ("[" * 3000 + "]" * 3000, json.dumps(nested(MAX_JSON_DEPTH + 1)), "[18446744073709551616]"):
        with pytest.raises(JSONLimitError):
            loads(text)
    with pytest.raises(json.JSONDecodeError):
        loads("{")
