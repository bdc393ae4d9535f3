"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.json_limits import too_deep_message
from app.serving.backends.base import BackendError


class APIError(Exception):
    """An error the server answers with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    @classmethod
    def from_backend(cls, exc: BackendError) -> APIError:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return cls(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code, headers=headers)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_deep() -> APIError:
    """The 400 of a JSON value nested deeper than ``MAX_JSON_DEPTH``."""
    return bad_request(f"The request body is invalid: {too_deep_message()}.", code="json_too_deep")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def model_not_found(model: str, available: Sequence[str]) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist. This server serves: {', '.join(available)}.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # pydantic names union members in the location (e.g. "str", "list[int]"): not part of the field path
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in _UNION_TAGS]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after", "function-plain"})


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 for pydantic/FastAPI validation errors, naming the first offending field as ``param``."""
    if not errors:
        return bad_request("the request body is invalid")
    first = errors[0]
    kind = str(first.get("type", ""))
    if kind in ("json_too_deep", "json_integer_too_large", "json_invalid_unicode"):  # app.json_limits: ctx["loc"]
        param = _loc_to_param(tuple((first.get("ctx") or {}).get("loc", ())))
        where = f" (in '{param}')" if param else ""
        return bad_request(f"The request body is invalid: {first.get('msg')}{where}.", param=param, code=kind)
    if kind == "json_invalid" and "recursion limit" in str(first.get("ctx", "")):  # pydantic's own JSON parser
        return too_deep()
    if kind == "nul_character":
        return bad_request(f"Invalid value: {first.get('msg')}", param=_loc_to_param(first.get("loc", ())),
                           code="nul_character")
    if kind in ("json_invalid", "json_type"):
        return bad_request(
            "The request body is not valid JSON: send a JSON object with Content-Type: application/json.",
            code="invalid_json",
        )
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if kind == "missing" and param:
        return bad_request(f"'{param}' is a required property", param=param)
    if param is None and kind in ("model_attributes_type", "dict_type"):
        return bad_request(
            "The request body must be a JSON object, sent with Content-Type: application/json.",
            code="invalid_json",
        )
    others = len(errors) - 1
    more = f" (and {others} more problem{'s' if others > 1 else ''})" if others else ""
    where = f"'{param}': " if param else ""
    return bad_request(f"Invalid value for {where}{msg}{more}", param=param)
