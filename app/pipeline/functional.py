"""Stateless ops on Values (``import app.pipeline.functional as F``).

Every op returns a Value and never raises: a failure is an ERROR Value naming the op and its input refs, and an
ERROR input short-circuits (the first error, positional args left to right then kwargs by sorted key, is
returned; the others are listed in ``meta["causes"]``). Inside a trace an op whose inputs are traced records an
``F.<name>`` node that runs at execution time on the real payloads.
"""

from __future__ import annotations

import builtins
import json
import math
import re
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from app.pipeline.context import get_active_tracer
from app.pipeline.ops import OPS, install_namespace, register
from app.pipeline.values import (
    Value,
    ValueKind,
    _infer_kind,
    collect_refs,
    error_value,
    first_error_value,
    iter_values,
    unwrap,
)

_MISSING: Any = object()
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


class OpError(ValueError):
    """Raised inside an op implementation; becomes an ERROR Value."""


def _as_value(result: Any) -> Value:
    if isinstance(result, Value):
        return result
    return Value(_infer_kind(result), result)


def run_op(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
    """Run op ``name`` eagerly on concrete arguments (what an ``F.*`` graph node does at execution time)."""
    try:
        impl, handles_errors = OPS[name]
    except KeyError:
        return error_value(OpError(f"unknown op {name!r}"), op=name)
    if not handles_errors:
        errors = [v for v in iter_values(*args, **kwargs) if v.kind is ValueKind.ERROR]
        if errors:
            primary = errors[0]
            meta = dict(primary.meta)
            if len(errors) > 1:
                causes = list(meta.get("causes", []))
                causes.extend({"ref": e.ref, "message": str(e.payload)} for e in errors[1:])
                meta["causes"] = causes
            return Value(ValueKind.ERROR, primary.payload, primary.ref, meta)
    try:
        return _as_value(impl(*args, **kwargs))
    except Exception as exc:  # ops never raise: the failure is data
        return error_value(exc, op=name, input_refs=collect_refs(*args, **kwargs))


def _op(name: str, *, handles_errors: bool = False) -> Callable[[_Fn], _Fn]:
    full = f"F.{name}"

    def decorate(impl: _Fn) -> _Fn:
        register(full, impl, handles_errors)

        @wraps(impl)
        def op(*args: Any, **kwargs: Any) -> Value:
            tracer = get_active_tracer()
            if tracer is not None and tracer.is_traced(args, kwargs):
                return tracer.record_op(full, args, kwargs)
            return run_op(full, args, kwargs)

        return op  # type: ignore[return-value]

    return decorate


def _text(x: Any) -> str:
    """The text of a value: strings as they are, structured data as stable JSON."""
    payload = unwrap(x)
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict | list | tuple):
        return json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    if hasattr(payload, "model_dump_json"):
        return str(payload.model_dump_json())
    return str(payload)


# -- text ---------------------------------------------------------------------------------------------------
_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")


def _substitute(template: str, variables: dict[str, Any], default: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        key = match.group(1).strip()
        if key in variables:
            return _text(variables[key])
        if default is _MISSING:
            raise KeyError(f"template variable {key!r} is missing (have: {sorted(variables)})")
        return str(default)

    return _FIELD.sub(replace, template)


@_op("render")
def render(template: Any, vars: Any = None) -> Value:
    """``{name}`` substitution (``{{``/``}}`` for literal braces); a missing variable is an ERROR."""
    variables = vars or {}
    if isinstance(variables, Value):
        variables = variables.payload
    return Value(ValueKind.TEXT, _substitute(_text(template), dict(variables), _MISSING))


@_op("try_render")
def try_render(template: Any, vars: Any = None, default: str = "") -> Value:
    """Like render, but a missing variable becomes ``default`` instead of an error."""
    variables = vars or {}
    if isinstance(variables, Value):
        variables = variables.payload
    return Value(ValueKind.TEXT, _substitute(_text(template), dict(variables), default))


@_op("concat")
def concat(*parts: Any, sep: str = "") -> Value:
    return Value(ValueKind.TEXT, _text(sep).join(_text(p) for p in parts))


@_op("format")
def format(fmt: Any, vars: Any = None) -> Value:
    """Python ``str.format`` with format specs (``{x:.2f}``) over the payloads of ``vars``."""
    variables = vars.payload if isinstance(vars, Value) else (vars or {})
    return Value(ValueKind.TEXT, _text(fmt).format(**{k: unwrap(v) for k, v in dict(variables).items()}))


@_op("strip")
def strip(text: Any, chars: str | None = None) -> Value:
    return Value(ValueKind.TEXT, _text(text).strip(unwrap(chars)))


@_op("lower")
def lower(text: Any) -> Value:
    return Value(ValueKind.TEXT, _text(text).lower())


@_op("upper")
def upper(text: Any) -> Value:
    return Value(ValueKind.TEXT, _text(text).upper())


# -- structured ---------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


@_op("parse_structured")
def parse_structured(text: Any, schema: Any = None) -> Value:
    """Parse JSON (a fenced ```json block is accepted), validated against a pydantic model or type if given."""
    raw = _text(text)
    fenced = _FENCE.match(raw)
    data = json.loads(fenced.group(1) if fenced else raw)
    if schema is not None:
        from pydantic import TypeAdapter

        validated = TypeAdapter(schema).validate_python(data)
        data = validated.model_dump(mode="json") if hasattr(validated, "model_dump") else validated
    return Value(ValueKind.STRUCTURED, data, meta={"schema": getattr(schema, "__name__", None)} if schema else {})


def _path(key_or_path: Any) -> list[Any]:
    key = unwrap(key_or_path)
    if isinstance(key, list | tuple):
        return list(key)
    if isinstance(key, str) and "." in key:
        return [int(p) if p.lstrip("-").isdigit() else p for p in key.split(".")]
    return [key]


@_op("select")
def select(struct: Any, key_or_path: Any, default: Any = _MISSING) -> Value:
    """``struct["a"]``, ``"a.b"`` or a list path; missing → ``default`` when given, else an ERROR."""
    current = unwrap(struct)
    for part in _path(key_or_path):
        try:
            if isinstance(current, dict) and isinstance(part, int) and part not in current:
                current = current[str(part)]  # "a.0" splits into ["a", 0]: a key "0" still matches
            elif isinstance(current, dict) or (isinstance(current, list | tuple) and isinstance(part, int)):
                current = current[part]
            elif isinstance(part, str) and hasattr(current, part) and not isinstance(current, str | bytes):
                current = getattr(current, part)
            else:
                raise KeyError(part)
        except (KeyError, IndexError, TypeError):
            if default is not _MISSING:
                return _as_value(unwrap(default))
            raise KeyError(f"path {unwrap(key_or_path)!r} not found (missing {part!r})") from None
    return _as_value(current)


@_op("merge")
def merge(*structs: Any) -> Value:
    merged: dict[Any, Any] = {}
    for s in structs:
        payload = unwrap(s)
        if not isinstance(payload, dict):
            raise TypeError(f"merge takes mappings, got {type(payload).__name__}")
        merged.update(payload)
    return Value(ValueKind.STRUCTURED, merged)


@_op("coerce")
def coerce(value: Any, kind: Any) -> Value:
    """Convert between kinds: TEXT→INT/FLOAT by parsing, INT→FLOAT, FLOAT→INT only when integral (or
    ``meta["allow_lossy"]``), STRUCTURED→TEXT as stable JSON; anything else is an ERROR."""
    source = value if isinstance(value, Value) else _as_value(value)
    target = ValueKind(unwrap(kind))
    payload = source.payload
    if source.kind is target:
        return source
    if source.kind is ValueKind.TEXT and target is ValueKind.INT:
        return Value(ValueKind.INT, int(str(payload).strip()))
    if source.kind is ValueKind.TEXT and target is ValueKind.FLOAT:
        return Value(ValueKind.FLOAT, float(str(payload).strip()))
    if source.kind is ValueKind.INT and target is ValueKind.FLOAT:
        return Value(ValueKind.FLOAT, float(payload))
    if source.kind is ValueKind.FLOAT and target is ValueKind.INT:
        if float(payload).is_integer() or source.meta.get("allow_lossy"):
            return Value(ValueKind.INT, int(payload))
        raise ValueError(f"{payload!r} is not integral; set meta['allow_lossy'] to truncate")
    if source.kind is ValueKind.STRUCTURED and target is ValueKind.TEXT:
        return Value(ValueKind.TEXT, json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str))
    raise TypeError(f"cannot coerce {source.kind.value} to {target.value}")


# -- numeric ------------------------------------------------------------------------------------------------
def _number(x: Any) -> int | float:
    payload = unwrap(x)
    if isinstance(payload, bool) or not isinstance(payload, int | float):
        raise TypeError(f"expected a number, got {type(payload).__name__}: {payload!r}")
    return payload


def _numeric(result: float, *inputs: Any) -> Value:
    if all(isinstance(unwrap(i), int) for i in inputs) and isinstance(result, int):
        return Value(ValueKind.INT, result)
    return Value(ValueKind.FLOAT, float(result))


@_op("add")
def add(a: Any, b: Any) -> Value:
    return _numeric(_number(a) + _number(b), a, b)


@_op("sub")
def sub(a: Any, b: Any) -> Value:
    return _numeric(_number(a) - _number(b), a, b)


@_op("mul")
def mul(a: Any, b: Any) -> Value:
    return _numeric(_number(a) * _number(b), a, b)


@_op("div")
def div(a: Any, b: Any) -> Value:
    divisor = _number(b)
    if divisor == 0:
        raise ZeroDivisionError("division by zero")
    return Value(ValueKind.FLOAT, _number(a) / divisor)


def _numbers(values: tuple[Any, ...], allow_empty: bool = False) -> list[int | float]:
    items: Any = values
    if len(values) == 1 and isinstance(unwrap(values[0]), list | tuple):
        items = unwrap(values[0])
    numbers = [_number(v) for v in items]
    if not numbers and not allow_empty:
        raise ValueError("no values given")
    return numbers


@_op("sum")
def sum(*values: Any) -> Value:
    """INT when every input is an int (the sum of nothing is 0), else FLOAT."""
    numbers = _numbers(values, allow_empty=True)
    if all(isinstance(n, int) for n in numbers):
        return Value(ValueKind.INT, builtins.sum(numbers))
    return Value(ValueKind.FLOAT, float(math.fsum(numbers)))


@_op("min")
def min(*values: Any) -> Value:
    numbers = _numbers(values)
    return _numeric(builtins.min(numbers), *numbers)


@_op("max")
def max(*values: Any) -> Value:
    numbers = _numbers(values)
    return _numeric(builtins.max(numbers), *numbers)


@_op("mean")
def mean(*values: Any) -> Value:
    numbers = _numbers(values)
    return Value(ValueKind.FLOAT, math.fsum(numbers) / len(numbers))


# -- responses ----------------------------------------------------------------------------------------------
@_op("extract_text")
def extract_text(value: Any) -> Value:
    payload = unwrap(value)
    if hasattr(payload, "content"):
        payload = payload.content
    elif isinstance(payload, dict) and "content" in payload:
        payload = payload["content"]
    return Value(ValueKind.TEXT, _text(payload))


_RESPONSE_FIELDS = ("model", "finish_reason", "input_tokens", "output_tokens", "completion_time_ms")


@_op("extract_meta")
def extract_meta(value: Any, key: str | None = None, default: Any = None) -> Value:
    payload = unwrap(value)
    # a raw response object (LLMResponse) carries its token counts itself; the Value's meta wins over them
    meta = {f: getattr(payload, f) for f in _RESPONSE_FIELDS if getattr(payload, f, None) is not None}
    meta.update(value.meta if isinstance(value, Value) else {})
    if key is None:
        return Value(ValueKind.STRUCTURED, dict(meta))
    return _as_value(meta.get(key, default))


@_op("with_meta")
def with_meta(value: Any, **meta: Any) -> Value:
    source = value if isinstance(value, Value) else _as_value(value)
    return Value(source.kind, source.payload, source.ref, {**source.meta, **meta})


async def chat_complete(
    client: Any,
    *,
    messages: list[dict[str, Any]],
    model: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    **kw: Any,
) -> Value:
    """One chat request through ``client.complete(LLMRequest)``: a RESPONSE Value, or an ERROR Value that keeps
    the HTTP status in ``meta["http_status"]``."""
    from app.pipeline.resources.types import LLMRequest

    failed = first_error_value(messages)
    if failed is not None:
        return failed
    try:
        extra = dict(kw.pop("extra_body", {}) or {})
        if model is not None:
            extra["model"] = model
        request = LLMRequest(
            prompt=list(unwrap(messages)), temperature=temperature, max_tokens=max_tokens, extra_body=extra, **kw
        )
        response = await client.complete(request)
    except Exception as exc:  # never raises: the failure (and its HTTP status) is data
        return error_value(exc, op="F.chat_complete", http_status=_http_status(exc))
    return Value(ValueKind.RESPONSE, response.content, meta=response_meta(response))


async def embed(
    client: Any,
    input: Any,
    *,
    model: str | None = None,
    dimensions: int | None = None,
    **kw: Any,
) -> Value:
    """One embeddings request through ``client.embed(EmbeddingRequest)``: a STRUCTURED Value holding one vector
    for a string (or one token-id list) and a list of vectors for a list, with the model and ``input_tokens`` in
    its meta; or an ERROR Value that keeps the HTTP status in ``meta["http_status"]``."""
    from app.pipeline.resources.types import EmbeddingRequest

    failed = first_error_value(input)
    if failed is not None:
        return failed
    try:
        extra = dict(kw.pop("extra_body", {}) or {})
        if model is not None:
            extra["model"] = model
        payload = unwrap(input)
        request = EmbeddingRequest(payload, dimensions=dimensions, extra_body=extra, **kw)
        response = await client.embed(request)
    except Exception as exc:  # never raises: the failure (and its HTTP status) is data
        return error_value(exc, op="F.embed", http_status=_http_status(exc))
    single = isinstance(payload, str) or (isinstance(payload, list) and bool(payload) and isinstance(payload[0], int))
    vectors = [list(v) for v in response.embeddings]
    meta = {"model": response.model, "input_tokens": response.input_tokens,
            "completion_time_ms": response.completion_time_ms}
    return Value(ValueKind.STRUCTURED, vectors[0] if single and vectors else vectors, meta=meta)


def _http_status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "http_status"):  # ours, the openai SDK's, others'
        status = getattr(exc, attr, None)
        if isinstance(status, int):
            return status
    return None


def response_meta(response: Any) -> dict[str, Any]:
    return {
        "model": response.model,
        "finish_reason": response.finish_reason,
        "input_tokens": response.input_tokens,
        "output_tokens": response.output_tokens,
        "completion_time_ms": response.completion_time_ms,
    }


# -- control ------------------------------------------------------------------------------------------------
@_op("unwrap_or", handles_errors=True)
def unwrap_or(value: Any, default: Any) -> Value:
    source = value if isinstance(value, Value) else _as_value(value)
    if source.kind is ValueKind.ERROR:
        fallback = _as_value(unwrap(default))
        # the node the error came from (its ref), or the error itself when it has none
        recovered_from = source.ref if source.ref is not None else repr(source.payload)
        return Value(fallback.kind, fallback.payload, meta={"recovered_from": recovered_from})
    return source


@_op("is_error", handles_errors=True)
def is_error(value: Any) -> Value:
    return Value(ValueKind.OTHER, isinstance(value, Value) and value.kind is ValueKind.ERROR)


@_op("constant")
def constant(value: Any) -> Value:
    """A literal output of a traced forward, as a node."""
    return _as_value(value)


# -- collections --------------------------------------------------------------------------------------------
@_op("map_values")
def map_values(fn: Callable[[Any], Any], values: Any) -> Value:
    return Value(ValueKind.STRUCTURED, [unwrap(fn(v)) for v in unwrap(values)])


@_op("zip_values")
def zip_values(*batches: Any) -> Value:
    lists = [list(unwrap(b)) for b in batches]
    if len({len(x) for x in lists}) > 1:
        raise ValueError(f"zip_values got batches of different lengths: {[len(x) for x in lists]}")
    return Value(ValueKind.STRUCTURED, [list(row) for row in zip(*lists, strict=True)])


@_op("stack_structured")
def stack_structured(values: Any) -> Value:
    items = unwrap(values) if not isinstance(values, list | tuple) else values
    return Value(ValueKind.STRUCTURED, [unwrap(v) for v in items])


# Values index through F.select (value["key"]) by way of the op registry, which values sit below.
install_namespace(sys.modules[__name__])
