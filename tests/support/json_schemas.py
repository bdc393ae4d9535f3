"""A Hypothesis strategy for JSON schemas of the kinds clients send as ``response_format``: objects with
required and optional properties, bounded strings (minLength/maxLength, equal bounds included), patterns, enums,
numbers with ranges, arrays with item counts, nested objects, anyOf and nullable types."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


@st.composite
def bounded_string(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    low = draw(st.none() | st.integers(0, 200))
    high = draw(st.none() | st.integers(0, 200))
    if low is not None:
        schema["minLength"] = low
    if high is not None:
        schema["maxLength"] = high if low is None else max(low, high) if draw(st.booleans()) else low
    return schema


strings = (
    bounded_string()
    | st.just({"type": "string"})
    | st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-z]+$", "^\\d{3}-\\d{4}$", "^[A-Z][a-z]*$"]))
    | st.builds(lambda v: {"type": "string", "enum": v}, st.lists(names, min_size=1, max_size=4, unique=True))
    | st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(["date", "email", "uuid", "date-time"]))
)


@st.composite
def numbers(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["integer", "number"]))
    schema: dict[str, Any] = {"type": kind}
    low = draw(st.none() | st.integers(-1000, 1000))
    if low is not None:
        schema["minimum"] = low
        if draw(st.booleans()):
            schema["maximum"] = low + draw(st.integers(0, 1000))
    return schema


scalars = strings | numbers() | st.just({"type": "boolean"}) | st.just({"type": "null"})


def _containers(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def obj(draw: st.DrawFn) -> dict[str, Any]:
        props = draw(st.dictionaries(names, inner, min_size=1, max_size=4))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True, max_size=len(props)))
        schema: dict[str, Any] = {"type": "object", "properties": props}
        if required:
            schema["required"] = required
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    @st.composite
    def arr(draw: st.DrawFn) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "array", "items": draw(inner)}
        low = draw(st.none() | st.integers(0, 3))
        if low is not None:
            schema["minItems"] = low
            if draw(st.booleans()):
                schema["maxItems"] = low + draw(st.integers(0, 3))
        return schema

    any_of = st.builds(lambda items: {"anyOf": items}, st.lists(inner, min_size=2, max_size=3))
    return obj() | arr() | any_of


@st.composite
def json_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """A top-level object schema, as response_format's json_schema has."""
    tree = st.recursive(scalars, _containers, max_leaves=6)
    props = draw(st.dictionaries(names, tree, min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True, max_size=len(props)))
    return {"type": "object", "properties": props, "required": required}
