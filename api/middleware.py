"""Pure ASGI middleware: request ids, one structured access-log line and HTTP metrics per request.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched and a client
disconnect still reaches the route as a cancellation.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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

        try:
            await self.app(scope, receive, send_with_id)
        finally:
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
