"""JSON forms stored in the database: item inputs, node values, item outputs and errors."""

from __future__ import annotations

from typing import Any

from app.jobs.inputs import BatchItem
from app.pipeline.graph import decode_json, encode_json
from app.pipeline.values import Value, ValueKind


def storable(obj: Any) -> Any:
    """JSON that every database accepts: PostgreSQL's JSONB refuses the NUL character (a model can emit it),
    so NULs in strings and keys become U+FFFD, the replacement character."""
    if isinstance(obj, str):
        return obj.replace("\x00", "\ufffd") if "\x00" in obj else obj
    if isinstance(obj, dict):
        return {storable(k): storable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [storable(v) for v in obj]
    return obj


def encode_item_input(item: BatchItem) -> dict[str, Any]:
    """The item's forward arguments in the graph JSON encoding (tuples, bytes and Values survive)."""
    return storable({"args": encode_json(list(item.args)), "kwargs": encode_json(dict(item.kwargs))})


def decode_item_input(data: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(decode_json(data.get("args") or [])), dict(decode_json(data.get("kwargs") or {}))


def encode_value(value: Value) -> Any:
    return storable(encode_json(value))


def decode_value(data: Any) -> Value:
    value = decode_json(data)
    return value if isinstance(value, Value) else Value(ValueKind.OTHER, value)


def to_jsonable(obj: Any) -> Any:
    """A pipeline output as plain, storable JSON: pydantic models dumped, tuples as lists, bytes as text."""
    if isinstance(obj, str):
        return storable(obj)
    if obj is None or isinstance(obj, bool | int | float):
        return obj
    if isinstance(obj, Value):
        return to_jsonable(obj.payload)
    if isinstance(obj, dict):
        return {storable(str(k)): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "model_dump"):
        return to_jsonable(obj.model_dump(mode="json"))
    if isinstance(obj, bytes | bytearray):
        return bytes(obj).decode("utf-8", "replace")
    if isinstance(obj, BaseException):
        return error_of(obj)
    return str(obj)


def error_of(exc: BaseException) -> dict[str, Any]:
    """An item's error as stored and streamed: the exception's type name and message."""
    return {"type": type(exc).__name__, "message": storable(str(exc))}
