"""The limits of the JSON the server accepts, the same for request bodies and for every JSONL line: nesting at
most :data:`MAX_JSON_DEPTH` levels deep, integers that fit in 64 bits, and text that is Unicode.

All are checked before anything else touches a value. Python's ``json``, pydantic, the stores' encoders and the
pipelines all recurse (a 3,000-deep array ends in RecursionError); orjson, which writes the responses and result
streams, cannot write an integer past 64 bits (a 2**70 in a job's metadata would break every read of it); and a
lone surrogate (``"\\ud800"``, which Python's ``json`` accepts and pydantic's own parser refuses) cannot be
tokenized, encoded as UTF-8 or stored.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic_core import PydanticCustomError

#: the deepest nesting of arrays and objects accepted (a scalar is depth 0, ``[]`` and ``{}`` depth 1)
MAX_JSON_DEPTH = 100
#: integers must fit in 64 bits, signed or unsigned (orjson's range)
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

TOO_DEEP, INTEGER, UNICODE = "json_too_deep", "json_integer_too_large", "json_invalid_unicode"
_SURROGATE = re.compile("[\ud800-\udfff]")  # after parsing, a surrogate in a str is always a lone one


class JSONLimitError(ValueError):
    """A JSON value breaks a limit: ``kind`` is one of ``json_too_deep``, ``json_integer_too_large`` and
    ``json_invalid_unicode``; ``loc`` the keys and indexes to the offending value (for depth: the top-level member
    that nests too deeply; empty for the value itself)."""

    def __init__(self, kind: str, loc: tuple[str | int, ...] = (), limit: int = MAX_JSON_DEPTH) -> None:
        super().__init__(problem_message(kind, limit))
        self.kind = kind
        self.loc = loc


def problem_message(kind: str, limit: int = MAX_JSON_DEPTH) -> str:
    if kind == TOO_DEEP:
        return f"the JSON nests arrays and objects more than {limit} levels deep, the limit"
    if kind == INTEGER:
        return f"the JSON holds an integer outside the 64-bit range [{INT_MIN}, {INT_MAX}]"
    return "the JSON holds a lone UTF-16 surrogate escape (like \\ud800), which is not Unicode text"


def too_deep_message(limit: int = MAX_JSON_DEPTH) -> str:
    return problem_message(TOO_DEEP, limit)


def _leaf_problem(value: Any) -> str | None:
    if type(value) is int and not INT_MIN <= value <= INT_MAX:
        return INTEGER
    if type(value) is str and _SURROGATE.search(value):
        return UNICODE
    return None


def _bad_keys(node: dict[Any, Any]) -> bool:
    try:
        return any(map(_SURROGATE.search, node))  # JSON keys are strings
    except TypeError:  # a dict built in Python may have other keys
        return any(_SURROGATE.search(key) for key in node if isinstance(key, str))


def _members(node: Any) -> Any:
    return node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()


def _scan(value: Any, limit: int) -> str | None:
    """The kind of the first problem found, or None: one breadth-first pass over the containers, a level at a
    time, so the walk never goes deeper than the limit. The leaf checks are inlined: this is the hot loop."""
    level = [value] if isinstance(value, dict | list) else []
    depth = 0
    search = _SURROGATE.search
    while level:
        depth += 1
        if depth > limit:
            return TOO_DEEP
        below: list[Any] = []
        for node in level:
            if isinstance(node, dict) and _bad_keys(node):
                return UNICODE
            for child in node.values() if isinstance(node, dict) else node:
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
                elif kind is str:
                    if search(child):
                        return UNICODE
                elif kind is int and not INT_MIN <= child <= INT_MAX:
                    return INTEGER
        level = below
    return _leaf_problem(value)


def _path_to_leaf(value: Any, kind: str, limit: int) -> tuple[str | int, ...]:
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if _leaf_problem(node) == kind:
            return path
        if len(path) < limit:
            for key, child in _members(node):
                if kind == UNICODE and isinstance(key, str) and _SURROGATE.search(key):
                    return (*path, key.encode("utf-8", "backslashreplace").decode())
                stack.append((child, (*path, key)))
    return ()


def json_problem(value: Any, limit: int = MAX_JSON_DEPTH) -> JSONLimitError | None:
    """What is wrong with ``value`` (parsed JSON: dicts, lists, scalars), or None. Iterative, so any depth is
    safe to check; where is only searched for once something is wrong."""
    kind = _scan(value, limit)
    if kind is None:
        return None
    if kind == TOO_DEEP:
        member = next((key for key, child in _members(value) if _scan(child, limit - 1) == kind), None)
        return JSONLimitError(kind, () if member is None else (member,), limit)
    return JSONLimitError(kind, _path_to_leaf(value, kind, limit), limit)


def check(value: Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """``value``, or :class:`JSONLimitError`."""
    problem = json_problem(value, limit)
    if problem is not None:
        raise problem
    return value


def validate(data: Any) -> Any:
    """For a pydantic ``mode="before"`` model validator: ``data``, or a validation error of the problem's kind
    (its context's ``loc`` says where)."""
    problem = json_problem(data)
    if problem is not None:
        raise PydanticCustomError(problem.kind, str(problem), {"loc": problem.loc})
    return data


def loads(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` that refuses what :func:`check` refuses with :class:`JSONLimitError` (a ``ValueError``, not
    a ``json.JSONDecodeError``); bad JSON still raises ``json.JSONDecodeError``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONLimitError(TOO_DEEP, (), limit) from None
    return check(value, limit)
