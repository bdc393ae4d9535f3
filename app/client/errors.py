"""The client's exceptions, named as the ``openai`` package names them.

Every answer of 400 or more raises an :class:`APIStatusError` subclass chosen by its status. It carries the
server's OpenAI-style body as it came (``.body == {"error": {"message", "type", "param", "code"}}``) and the
fields of its ``error`` object (``.message``, ``.type``, ``.param``, ``.code``). Unlike ``openai`` (whose ``.body``
is the inner ``error`` object), ``.body`` here is the whole body; ``.error`` is the inner object.

A server that cannot be reached raises :class:`APIConnectionError` (:class:`APITimeoutError` for a timeout), whose
``status_code`` is None.
"""

from __future__ import annotations

from typing import Any

import httpx


class InfEngineError(Exception):
    """The base of every error the client raises."""


class APIError(InfEngineError):
    """An error talking to the server. ``status_code`` is None when no answer came."""

    status_code: int | None = None

    def __init__(self, message: str, *, request: httpx.Request | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body
        error = body.get("error") if isinstance(body, dict) else None
        self.error: dict[str, Any] = error if isinstance(error, dict) else {}
        self.type: str | None = _text(self.error.get("type"))
        self.param: str | None = _text(self.error.get("param"))
        self.code: str | None = _text(self.error.get("code"))


class APIStatusError(APIError):
    """The server answered with a status of 400 or more."""

    status_code: int

    def __init__(self, message: str, *, response: httpx.Response, body: Any) -> None:
        super().__init__(message, request=response.request, body=body)
        self.response = response
        self.status_code = response.status_code
        self.headers = response.headers

    def __str__(self) -> str:
        return f"HTTP {self.status_code}: {self.message}"


class BadRequestError(APIStatusError):
    """400: the request is invalid (``.param`` names the field where the server knows it)."""


class AuthenticationError(APIStatusError):
    """401: no API key, or one the server does not know."""


class PermissionDeniedError(APIStatusError):
    """403."""


class NotFoundError(APIStatusError):
    """404: no such resource for this API key's tenant (another tenant's resources are not found either)."""


class ConflictError(APIStatusError):
    """409: the resource is in a state that forbids the request (e.g. an answered feedback request)."""


class PayloadTooLargeError(APIStatusError):
    """413: the body or file is larger than the server accepts (``INF_ENGINE_JOBS_MAX_BYTES``)."""


class UnprocessableEntityError(APIStatusError):
    """422."""


class RateLimitError(APIStatusError):
    """429: a tenant quota or a rate limit; ``retry_after`` is the server's Retry-After in seconds, if it sent one."""

    @property
    def retry_after(self) -> float | None:
        try:
            return float(self.headers.get("retry-after", ""))
        except ValueError:
            return None


class InternalServerError(APIStatusError):
    """500 or more."""


class APIConnectionError(APIError):
    """The server could not be reached, or the connection broke."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message, request=request)


class APITimeoutError(APIConnectionError):
    """The request timed out."""


class APIResponseValidationError(APIError):
    """A successful answer whose body does not have the shape the client expects (a server of another version)."""

    def __init__(self, message: str, *, response: httpx.Response, body: Any) -> None:
        super().__init__(message, request=response.request, body=body)
        self.response = response
        self.status_code = response.status_code


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_error(response: httpx.Response) -> APIStatusError:
    """The exception for an answer of 400 or more (its body must have been read)."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = response.text[:500] or response.reason_phrase
    kind = _BY_STATUS.get(response.status_code)
    if kind is None:
        kind = InternalServerError if response.status_code >= 500 else APIStatusError
    return kind(message, response=response, body=body)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
