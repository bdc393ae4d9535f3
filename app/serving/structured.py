"""Constrained output: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` fields
→ one :class:`StructuredOutputsParams` for the engine, and the request field it came from (for errors).

``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema`` (its
``schema``; without one, any JSON object). ``strict`` is accepted either way: a constraint always holds here.
vLLM's ``guided_decoding_backend`` and ``guided_whitespace_pattern`` are ignored with a debug log line (the
engine has one backend). At most one source may be set. JSON schemas are checked against their meta-schema here when a JSON-Schema
library is installed (``jsonschema``, else ``jsonschema_rs``), so a malformed schema is a 400 naming the
field before anything is queued; what only the grammar compiler can refuse (an unsupported keyword, a bad
regex or EBNF) fails at ``add_request`` and the backend reports it against the same field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from app.engine.core.sampling_params import StructuredOutputsParams
from app.serving.errors import bad_request
from app.serving.schemas import ChatCompletionRequest, CompletionRequest, StructuredOutputsRequest

log = logging.getLogger(__name__)

__all__ = [
    "GUIDED_FIELDS",
    "Structure",
    "check_json_schema",
    "request_structure",
    "structure",
    "upstream_structure_fields",
]

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_IGNORED_GUIDED = ("guided_decoding_backend", "guided_whitespace_pattern")
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class Structure:
    """What constrains a request's output, and the request field to name when it is refused."""

    params: StructuredOutputsParams
    param: str


def structure(param: str, **spec: Any) -> Structure:
    """A :class:`Structure` of ``spec``; the engine's own checks of it (a ValueError) are a 400 naming ``param``."""
    try:
        return Structure(StructuredOutputsParams(**spec), param)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def check_json_schema(schema: Any, param: str) -> dict[str, Any]:
    """``schema`` (an object, or JSON text of one) as a dict, checked against its meta-schema if a library for
    that is installed; a 400 naming ``param`` otherwise."""
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    problem = _meta_schema_problem(schema)
    if problem is not None:
        raise bad_request(f"{param} is not a valid JSON schema: {problem}", param)
    return schema


def _meta_schema_problem(schema: dict[str, Any]) -> str | None:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            return str(exc.message)
        return None
    try:
        import jsonschema_rs
    except ImportError:
        return None
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        return str(exc.message)
    except Exception as exc:  # an unknown $schema dialect, a broken $ref: the compiler decides
        log.debug("meta-schema check skipped: %s", exc)
    return None


def _from_response_format(req: ChatCompletionRequest | CompletionRequest) -> Structure | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return structure("response_format", json_object=True)
    schema = check_json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    return structure("response_format", json=schema)


def _from_structured_outputs(raw: StructuredOutputsRequest | None) -> Structure | None:
    if raw is None:
        return None
    given = {
        "json": raw.json_,
        "regex": raw.regex,
        "choice": raw.choice,
        "grammar": raw.grammar,
        "json_object": raw.json_object or None,
        "structural_tag": raw.structural_tag,
    }
    chosen = [k for k in _KINDS if given[k] is not None]
    if len(chosen) != 1:
        named = ", ".join(chosen) if chosen else "none"
        raise bad_request(
            f"structured_outputs must set exactly one of {', '.join(_KINDS)} (got: {named})", "structured_outputs"
        )
    (kind,) = chosen
    return _structure(kind, given[kind], "structured_outputs", f"structured_outputs.{kind}")


def _structure(kind: str, value: Any, param: str, where: str) -> Structure:
    if kind == "json":
        return structure(param, json=check_json_schema(value, where))
    if kind == "json_object":
        return structure(param, json_object=True)
    if kind == "choice":
        if not value or any(not isinstance(c, str) for c in value):
            raise bad_request(f"{where} must be a non-empty list of strings", where)
        return structure(param, choice=list(value))
    if kind == "structural_tag":
        tag = check_json_object(value, where)
        return structure(param, structural_tag=tag)
    if not value:
        raise bad_request(f"{where} must be a non-empty string", where)
    if kind == "regex":
        return structure(param, regex=value)
    return structure(param, grammar=value)


def check_json_object(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON object", param)
    return value


def _from_guided(req: ChatCompletionRequest | CompletionRequest) -> Structure | None:
    for name in _IGNORED_GUIDED:
        if getattr(req, name) is not None:
            log.debug("ignoring %s=%r: the engine has one structured-output backend", name, getattr(req, name))
    chosen = [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    if not chosen:
        return None
    if len(chosen) > 1:
        raise bad_request(f"send at most one of {', '.join(GUIDED_FIELDS)} (got {', '.join(chosen)})", chosen[1])
    (name,) = chosen
    return _structure(name.removeprefix("guided_"), getattr(req, name), name, name)


def request_structure(req: ChatCompletionRequest | CompletionRequest) -> Structure | None:
    """The constraint the request's own fields ask for (not its tools), or None; a 400 when several do."""
    found = [
        s
        for s in (_from_response_format(req), _from_structured_outputs(req.structured_outputs), _from_guided(req))
        if s is not None
    ]
    if len(found) > 1:
        raise bad_request(
            f"{found[0].param} and {found[1].param} both constrain the output: send only one of them",
            found[1].param,
        )
    return found[0] if found else None


def upstream_structure_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The structured-output fields as the client sent them, for a backend that forwards them upstream."""
    names = ("response_format", "structured_outputs", *GUIDED_FIELDS, *_IGNORED_GUIDED)
    return {name: _dumped(getattr(req, name)) for name in names if getattr(req, name) is not None}


def _dumped(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(by_alias=True, exclude_none=True) if dump is not None else value
