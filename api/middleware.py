"""Pure ASGI middleware: request ids, one structured access-log line and HTTP metrics per request; the guard that
refuses oversized bodies (413) and NUL characters in URLs (400) before any route runs.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched and a client
disconnect still reaches the route as a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from typing import Any
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.logs import bind as bind_log_context
from app.logs import unbind as unbind_log_context
from app.serving.errors import error_body
from app.serving.logs import access_log
from app.serving.metrics import ServingMetrics

REQUEST_ID_HEADER = b"x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if _SAFE_ID.match(text):
                return text
            break
    return uuid.uuid4().hex


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 500
        header = (REQUEST_ID_HEADER, request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        tokens = bind_log_context(request_id=request_id)  # every log line of this request carries its id
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            unbind_log_context(tokens)
            latency = time.perf_counter() - start
            route: Any = scope.get("route")
            handler = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.observe_http(handler, method, status, latency)
            client = scope.get("client")
            access_log(
                request_id=request_id,
                method=method,
                path=scope.get("path", ""),
                status=status,
                latency_ms=round(latency * 1000, 2),
                client=f"{client[0]}:{client[1]}" if client else None,
            )


# -- hostile requests: refused before any route sees them ----------------------------------------------------
#: /tokenize and /detokenize are open (as in vLLM) and their work grows with the body: a smaller limit
TOKENIZE_MAX_BYTES = 4 * 1024 * 1024
SMALL_BODY_ROUTES = {"/tokenize": TOKENIZE_MAX_BYTES, "/detokenize": TOKENIZE_MAX_BYTES}


class RequestTooLarge(HTTPException):
    """The body exceeds its limit. An ``HTTPException``, so that FastAPI's body parsing passes it through and
    ``api.errors`` answers 413 even when the excess is noticed while a route is reading a chunked body."""

    def __init__(self, limit: int, accepted_by: str) -> None:
        super().__init__(413, f"The request body is larger than {limit} bytes, the most {accepted_by}.")
        self.limit = limit


def too_large_response(exc: RequestTooLarge) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), code="payload_too_large"), status_code=413)


def _nul_in_url(scope: Scope) -> JSONResponse | None:
    """A 400 for a NUL character (``%00``) in the path or the query string: no id or name holds one, and
    PostgreSQL cannot even compare text with it."""
    if "\x00" in scope.get("path", ""):
        message = "The URL path contains a NUL character (%00); no id or name on this server contains one."
        return JSONResponse(error_body(message, code="nul_character"), status_code=400)
    query: bytes = scope.get("query_string", b"")
    if b"%00" in query or b"\x00" in query:
        pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        param = next((key for key, value in pairs if "\x00" in key or "\x00" in value), None)
        message = f"The query parameter {param!r} contains a NUL character (%00)." if param else (
            "The query string contains a NUL character (%00).")
        return JSONResponse(error_body(message, param=param, code="nul_character"), status_code=400)
    return None


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


#: an early answer (a 413, a 401) first reads what is left of the body, up to these bounds, as nginx's lingering
#: close does: a client that sends its whole body before reading (Python's urllib) would otherwise see its
#: connection reset instead of the answer. Past them the connection closes as before.
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_MAX_SECONDS = 10.0


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, within :data:`DRAIN_MAX_BYTES` and :data:`DRAIN_MAX_SECONDS`."""
    drained = 0

    async def read() -> None:
        nonlocal drained
        while drained <= DRAIN_MAX_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(read(), DRAIN_MAX_SECONDS)


class RequestGuardMiddleware:
    """Refuses, in one place, the requests no route should see: a body larger than ``max_bytes`` (413, from
    Content-Length before anything is read, or counted while a chunked body streams) and a NUL in the URL (400).
    Both answer with the OpenAI error body. Any error answer sent before the body was read (these, a 401) first
    drains the body (bounded, see :data:`DRAIN_MAX_BYTES`), so that every client can read it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def tracked_receive() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def lingering_send(message: Message) -> None:
            if message["type"] == "http.response.start" and int(message["status"]) >= 400 and not body_done:
                await _drain(tracked_receive)
            await send(message)

        await self._guard(scope, tracked_receive, lingering_send)

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = _nul_in_url(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        small = SMALL_BODY_ROUTES.get(scope.get("path", ""))
        if small is not None and small < self.max_bytes:
            limit, setting = small, f"{scope['path']} accepts"
        else:
            limit, setting = self.max_bytes, "this server accepts (INF_ENGINE_MAX_REQUEST_BYTES)"
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await too_large_response(RequestTooLarge(limit, setting))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit, setting)
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestTooLarge as exc:  # raised where no exception handler saw it (e.g. a background read)
            if started:
                raise
            await too_large_response(exc)(scope, receive, send)
