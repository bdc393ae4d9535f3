"""Stored JSON forms of inputs, node values and outputs."""

from __future__ import annotations

from pydantic import BaseModel

from app.jobs.encoding import (
    decode_item_input,
    decode_value,
    encode_item_input,
    encode_value,
    error_of,
    storable,
    to_jsonable,
)
from app.jobs.graphs import shape_key
from app.jobs.inputs import BatchItem
from app.pipeline.values import Value, ValueKind


class Verdict(BaseModel):
    label: str
    score: float


def test_item_inputs_round_trip() -> None:
    item = BatchItem("a", ("text", (1, 2)), {"blob": b"\x01\x02", "n": 3})
    args, kwargs = decode_item_input(encode_item_input(item))
    assert args == ("text", (1, 2)) and kwargs == {"blob": b"\x01\x02", "n": 3}


def test_values_round_trip_with_meta() -> None:
    value = Value(ValueKind.RESPONSE, "hello", "LLMInference_1", {"input_tokens": 3, "alias": "a"})
    back = decode_value(encode_value(value))
    assert (back.kind, back.payload, back.ref, back.meta) == (value.kind, "hello", "LLMInference_1", value.meta)
    assert decode_value(7).kind is ValueKind.OTHER  # a bare stored value is still a Value


def test_nul_characters_never_reach_the_database() -> None:
    assert storable({"k\x00": ["a\x00b", 1, None]}) == {"k\ufffd": ["a\ufffdb", 1, None]}
    assert "\x00" not in str(encode_value(Value(ValueKind.TEXT, "x\x00y")))
    assert to_jsonable({"out": "x\x00"}) == {"out": "x\ufffd"}
    assert error_of(ValueError("bad\x00")) == {"type": "ValueError", "message": "bad\ufffd"}


def test_outputs_become_plain_json() -> None:
    output = {"verdict": Verdict(label="ok", score=0.5), "pair": (1, "two"), "raw": b"bytes",
              "value": Value(ValueKind.INT, 4)}
    assert to_jsonable(output) == {"verdict": {"label": "ok", "score": 0.5}, "pair": [1, "two"], "raw": "bytes",
                                   "value": 4}


def test_shape_key_ignores_values_but_not_structure() -> None:
    assert shape_key({"review": "a"}) == shape_key({"review": "b"})
    assert shape_key({"review": "a"}) != shape_key({"text": "a"})
    assert shape_key(["a", "b"]) != shape_key(["a"])
    assert shape_key(1) != shape_key("1")
