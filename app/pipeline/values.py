"""Values: the data that flows between pipeline nodes, with the id of the node that made it.

A ``Value`` pairs a payload with a ``kind`` and a ``ref`` (the graph node that produced it). During tracing the
payload is not known yet; the ref alone carries the dependency. Errors are values too (``ValueKind.ERROR``) so a
failure flows downstream as data instead of unwinding the whole pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from app.pipeline.context import get_active_tracer
from app.pipeline.ops import public_op


class ValueKind(str, Enum):
    TEXT = "text"
    FSTRING = "fstring"
    RESPONSE = "response"
    STRUCTURED = "structured"
    INT = "int"
    FLOAT = "float"
    ERROR = "error"
    TOOL_RESULT = "tool_result"
    BINARY = "binary"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class ValueRef:
    """The placeholder stored in a graph node's args where a traced Value was passed."""

    ref: str


@dataclass(slots=True)
class Value:
    """A payload of some ``kind``; ``ref`` names the graph node that produced it (None for literals)."""

    kind: ValueKind
    payload: Any
    ref: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: Any) -> Value:
        return public_op("select")(self, key)

    def get(self, key: Any, default: Any = None) -> Value:
        return public_op("select")(self, key, default)

    def __iter__(self) -> Iterator[Any]:
        # Without this, iter() would fall back to __getitem__(0), (1), ... which never raises IndexError (missing
        # keys are ERROR Values): `for x in value` and list(value) would loop forever.
        tracer = get_active_tracer()
        if tracer is not None and self.ref is not None and tracer.owns_ref(self.ref):
            raise TypeError(
                f"cannot iterate a traced Value ({self.ref}): its length is only known at run time. Index it "
                "(value[0], value['key']), use F.map_values, or iterate inside a leaf module's forward."
            )
        if self.kind is ValueKind.ERROR:
            return iter(())
        try:
            return iter(self.payload)
        except TypeError:
            raise TypeError(f"a {self.kind.value} Value is not iterable") from None

    @property
    def is_error(self) -> bool:
        return self.kind is ValueKind.ERROR

    def __str__(self) -> str:
        # Inside a trace the payload does not exist yet: hand out a placeholder that the tracer turns into an
        # F.render node when the string reaches a module call or an output (never the Value's repr).
        tracer = get_active_tracer()
        if tracer is not None and self.ref is not None and tracer.owns_ref(self.ref):
            return tracer.placeholder_for(self)
        if self.kind is ValueKind.ERROR:
            return f"Error: {self.payload}"
        return str(self.payload)

    def __repr__(self) -> str:
        # f"{v!r}" (or a container of Values formatted into a string) inside a trace must not bake this repr into
        # a prompt: it becomes the same placeholder as str(v), rendered later with the real payload.
        tracer = get_active_tracer()
        if tracer is not None and self.ref is not None and tracer.owns_ref(self.ref):
            return tracer.placeholder_for(self)
        return f"Value(kind={self.kind!r}, payload={self.payload!r}, ref={self.ref!r}, meta={self.meta!r})"

    def __format__(self, spec: str) -> str:
        if spec:
            tracer = get_active_tracer()
            if tracer is not None and self.ref is not None and tracer.owns_ref(self.ref):
                raise TypeError(
                    f"cannot apply format spec {spec!r} to a traced Value ({self.ref}); its payload is only known "
                    "at run time. Use F.format(...) or a plain {} placeholder."
                )
            return format(self.payload, spec)
        return self.__str__()

    def __bool__(self) -> bool:
        tracer = get_active_tracer()
        if tracer is not None and self.ref is not None and tracer.owns_ref(self.ref):
            raise TypeError(
                f"the truth of a traced Value ({self.ref}) is only known at run time: branch on it inside a "
                "leaf module's forward, or use F ops such as F.unwrap_or and F.is_error."
            )
        return bool(self.payload)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes a Value does not have: point tracing users at the right tool.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"'Value' has no attribute {name!r}. Inside a traced forward() a Value is a placeholder for a result "
            f"that does not exist yet; transform it with app.pipeline.functional (F.*) ops or a leaf module, "
            f"or use .payload outside of tracing."
        )


def _infer_kind(x: Any) -> ValueKind:
    if isinstance(x, bool):
        return ValueKind.OTHER
    if isinstance(x, str):
        return ValueKind.TEXT
    if isinstance(x, int):
        return ValueKind.INT
    if isinstance(x, float):
        return ValueKind.FLOAT
    if isinstance(x, bytes | bytearray):
        return ValueKind.BINARY
    if isinstance(x, dict | list | tuple):
        return ValueKind.STRUCTURED
    if isinstance(x, BaseException):
        return ValueKind.ERROR
    return ValueKind.OTHER


class LiftsToValue(Protocol):
    """What lifts itself into a Value (a ``Parameter``: its value, with ref ``param:<dotted.name>``)."""

    def as_value(self, kind: ValueKind | None = None) -> Value: ...


def _lifts_to_value(x: Any) -> bool:
    return callable(getattr(type(x), "as_value", None))


def valueify(x: Any, kind: ValueKind | None = None) -> Any:
    """Wrap raw data into Values: containers become containers of Values unless ``kind`` is given. A Parameter
    (anything with ``as_value``, see ``LiftsToValue``) lifts itself."""
    if isinstance(x, Value):
        if kind is not None and kind is not x.kind:
            return Value(kind, x.payload, x.ref, dict(x.meta))
        return x
    if _lifts_to_value(x):
        lifted: LiftsToValue = x
        return lifted.as_value(kind)
    if kind is not None:
        return Value(kind, x)
    if isinstance(x, dict):
        return {k: valueify(v) for k, v in x.items()}
    if isinstance(x, list):
        return [valueify(v) for v in x]
    if isinstance(x, tuple):
        return tuple(valueify(v) for v in x)
    return Value(_infer_kind(x), x)


def unwrap(x: Any) -> Any:
    """The raw payloads of Values, recursively through dicts, lists and tuples (payloads included)."""
    if isinstance(x, Value):
        return unwrap(x.payload)
    if isinstance(x, dict):
        return {k: unwrap(v) for k, v in x.items()}
    if isinstance(x, list):
        return [unwrap(v) for v in x]
    if isinstance(x, tuple):
        return tuple(unwrap(v) for v in x)
    return x


def iter_values(*args: Any, **kwargs: Any) -> Iterator[Value]:
    """Every Value in args then kwargs (sorted by key), depth first: the deterministic order errors use."""
    for arg in args:
        yield from _walk(arg)
    for key in sorted(kwargs):
        yield from _walk(kwargs[key])


def _walk(obj: Any) -> Iterator[Value]:
    if isinstance(obj, Value):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _walk(v)


def collect_refs(*args: Any, **kwargs: Any) -> list[str]:
    """The distinct refs of the Values (and ValueRefs) in args and kwargs, in first-seen order."""
    seen: dict[str, None] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, Value):
            if obj.ref is not None:
                seen.setdefault(obj.ref)
        elif isinstance(obj, ValueRef):
            seen.setdefault(obj.ref)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                visit(v)

    for arg in args:
        visit(arg)
    for key in sorted(kwargs):
        visit(kwargs[key])
    return list(seen)


def replace_values_with_refs(obj: Any) -> Any:
    """Replace each Value that has a ref by a ValueRef, recursively; Values without a ref stay as they are."""
    if isinstance(obj, Value):
        return ValueRef(obj.ref) if obj.ref is not None else obj
    if isinstance(obj, dict):
        return {k: replace_values_with_refs(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [replace_values_with_refs(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(replace_values_with_refs(v) for v in obj)
    return obj


def has_error_value(*args: Any, **kwargs: Any) -> bool:
    return first_error_value(*args, **kwargs) is not None


def first_error_value(*args: Any, **kwargs: Any) -> Value | None:
    """The first ERROR Value: positional args left to right, then kwargs by sorted key."""
    for value in iter_values(*args, **kwargs):
        if value.kind is ValueKind.ERROR:
            return value
    return None


def error_value(exc: BaseException, **meta: Any) -> Value:
    """An ERROR Value carrying ``exc``."""
    return Value(ValueKind.ERROR, exc, meta=dict(meta))
