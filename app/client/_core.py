"""The one HTTP core both clients run on: base URL and key, requests, answers checked and parsed, errors raised.

It is asynchronous (httpx's ``AsyncClient``); the synchronous :class:`app.client.Client` runs the same coroutines on
an event loop of its own (``app.client._sync``), so every call is written once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from app.client.errors import APIConnectionError, APIResponseValidationError, APITimeoutError, status_error

#: where ``inf-engine serve`` listens unless told otherwise
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 60.0

M = TypeVar("M", bound=BaseModel)


def normalize_base_url(url: str) -> str:
    """The server's root URL: a trailing slash or ``/v1`` (as OpenAI clients are given it) is dropped."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("base_url is empty: give the server's URL, e.g. http://127.0.0.1:8000")
    return url.removesuffix("/v1").rstrip("/")


def path(template: str, *ids: str | int) -> str:
    """``template`` with each ``{}`` replaced by an id, quoted so that it stays one path segment."""
    parts = []
    for value in ids:
        text = str(value)
        if not text:
            raise ValueError(f"an empty id in {template}")
        parts.append(quote(text, safe=""))
    return template.format(*parts)


def query(**params: Any) -> dict[str, Any]:
    """Query parameters without the ones left None; lists become comma-separated and booleans lower case."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, list | tuple | set | frozenset):
            value = ",".join(str(v) for v in value)
        out[key] = value
    return out


def body(**fields: Any) -> dict[str, Any]:
    """A JSON body without the fields left None (the server's defaults apply to them)."""
    return {key: value for key, value in fields.items() if value is not None}


class HTTPCore:
    """Requests against one server with one API key (``Authorization: Bearer``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float | httpx.Timeout | None,
        headers: Mapping[str, str] | None,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        from app.version import version

        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key
        sent = {"User-Agent": f"inf-engine-client/{version()}", **(headers or {})}
        if api_key:
            sent["Authorization"] = f"Bearer {api_key}"
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=sent, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """The answer to one request; a status of 400 or more raises its :mod:`app.client.errors` class."""
        try:
            response = await self.http.request(method, url, **kwargs)
        except httpx.TimeoutException as exc:
            raise APITimeoutError(f"the request to {self.base_url}{url} timed out ({type(exc).__name__})",
                                  request=exc.request) from exc
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc
        if response.status_code >= 400:
            raise status_error(response)
        return response

    async def json(self, method: str, url: str, **kwargs: Any) -> Any:
        response = await self.send(method, url, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise APIResponseValidationError(f"{method} {url} answered {response.status_code} without JSON",
                                             response=response, body=response.text[:500]) from None

    async def call(self, model: type[M], method: str, url: str, **kwargs: Any) -> M:
        """The answer parsed as ``model``."""
        response = await self.send(method, url, **kwargs)
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise APIResponseValidationError(
                f"{method} {url} answered a body that is not a {model.__name__}: "
                + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3]),
                response=response, body=response.text[:2000],
            ) from None

    @asynccontextmanager
    async def stream(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        """A streamed answer; an error status raises (with its body read) before anything is yielded."""
        request = self.http.build_request(method, url, **kwargs)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise APITimeoutError(f"the request to {self.base_url}{url} timed out", request=request) from exc
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                raise status_error(response)
            yield response
        except httpx.TransportError as exc:  # the connection broke while the answer streamed
            raise APIConnectionError(f"the stream from {self.base_url}{url} broke ({type(exc).__name__}: {exc})",
                                     request=request) from exc
        finally:
            await response.aclose()


def _unreachable(base_url: str, exc: httpx.TransportError) -> APIConnectionError:
    try:
        request: httpx.Request | None = exc.request
    except RuntimeError:  # an error raised before a request existed
        request = None
    return APIConnectionError(f"cannot reach the inf-engine server at {base_url} ({type(exc).__name__}: {exc})",
                              request=request)
