"""LLM clients: an OpenAI-compatible HTTP client on aiohttp, and a registry for in-process clients.

The HTTP client is the ceiling of the whole pipeline layer (see DESIGN.md: aiohttp sustained ~10x what httpx's
async client did at 64 requests in flight), so the hot path is kept lean: one pooled keep-alive session per event
loop, pre-built headers and URL, bytes in and out. It never retries: the scheduler owns retries and backoff.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import functools
import json
import re
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import aiohttp

from app.pipeline.resources.config import EndpointConfig
from app.pipeline.resources.errors import (
    ConfigurationError,
    RateLimitError,
    ResourceError,
    TransientError,
)
from app.pipeline.resources.types import EmbeddingRequest, EmbeddingResponse, LLMRequest, LLMResponse

try:  # orjson is optional: faster, but the stdlib json works everywhere.
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    _loads = json.loads


DEFAULT_BASE_URLS: dict[str, str] = {
    "openai": "https://api.openai.com/v1",
    # Anthropic serves an OpenAI-compatible chat/completions endpoint under its /v1 path.
    "anthropic": "https://api.anthropic.com/v1",
}

# Statuses that mean "try again later" although they are 4xx.
_TRANSIENT_4XX = frozenset({408, 409})


@runtime_checkable
class LLMClient(Protocol):
    """What the resource manager needs from any client (HTTP or in-process engine)."""

    async def complete(self, request: LLMRequest) -> LLMResponse: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class EmbeddingClient(Protocol):
    """A client that also serves ``/v1/embeddings`` (the HTTP client, the server's in-process one)."""

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse: ...


ClientFactory = Callable[[EndpointConfig], LLMClient]
_FACTORIES: dict[str, ClientFactory] = {}


def register_client_factory(provider: str, factory: ClientFactory | None) -> ClientFactory | None:
    """Serve endpoints of ``provider`` that have no ``base_url`` with ``factory`` (``None`` unregisters).

    This is how an in-process engine plugs in for provider ``"native"``. Endpoints with a ``base_url`` always go
    over HTTP. Returns the factory previously registered, if any.
    """
    provider = provider.strip().lower()
    previous = _FACTORIES.get(provider)
    if factory is None:
        _FACTORIES.pop(provider, None)
    else:
        _FACTORIES[provider] = factory
    return previous


def create_client(config: EndpointConfig, *, alias: str | None = None) -> LLMClient:
    """The client for ``config``: a registered factory when it has no base_url, else the HTTP client."""
    if config.base_url is None:
        factory = _FACTORIES.get(config.provider)
        if factory is not None:
            return factory(config)
    return OpenAICompatibleClient(config, alias=alias)


def resolve_base_url(config: EndpointConfig) -> str:
    """The base URL to call, or a ConfigurationError saying how to supply one."""
    if config.base_url:
        return config.base_url
    default = DEFAULT_BASE_URLS.get(config.provider)
    if default is not None:
        return default
    if config.provider == "native":
        raise ConfigurationError(
            f"native endpoint for model {config.model!r} has no base_url: give the URL of our engine's server "
            "(e.g. 'http://127.0.0.1:8000/v1'), or run the engine in this process by calling "
            "app.serving.embedded.register_embedded_engine() first (inf-engine run does so without --resources)"
        )
    raise ConfigurationError(
        f"{config.provider} endpoint for model {config.model!r} needs a base_url "
        "(e.g. 'http://127.0.0.1:8000/v1')"
    )


@functools.lru_cache(maxsize=256)
def _schema_format(tp: type) -> dict[str, Any]:
    from pydantic import BaseModel, TypeAdapter

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        schema = tp.model_json_schema()
    else:
        schema = TypeAdapter(tp).json_schema()
    # OpenAI wants ^[a-zA-Z0-9_-]{1,64}$ (our server checks the length)
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", getattr(tp, "__name__", "") or "response")[:64]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def response_format_payload(response_format: Any) -> Any:
    """Translate ``LLMRequest.response_format`` into the OpenAI ``response_format`` field."""
    if response_format is None or isinstance(response_format, dict):
        return response_format
    if isinstance(response_format, str):
        if response_format in ("json", "json_object"):
            return {"type": "json_object"}
        if response_format == "text":
            return {"type": "text"}
        raise ValueError(
            f"response_format string {response_format!r} is not understood; use 'json', 'text', a dict or a type"
        )
    try:
        return _schema_format(response_format)
    except TypeError as exc:  # unhashable or not a type pydantic can describe
        raise ValueError(
            f"response_format {response_format!r} is neither a dict nor a type pydantic can turn into a JSON schema"
        ) from exc


def chat_payload(request: LLMRequest, *, model: str | None = None) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body ``request`` stands for, as every client sends it (the HTTP client and the
    in-process engine's): ``response_format`` in OpenAI's shape, ``tools`` and ``tool_choice`` as given, and
    ``extra_body`` last, so that its fields win over everything else."""
    payload: dict[str, Any] = {"messages": request.messages()}
    if model is not None:
        payload["model"] = model
    if request.temperature is not None:
        payload["temperature"] = request.temperature
    if request.max_tokens is not None:
        payload["max_tokens"] = request.max_tokens
    if request.stop:
        payload["stop"] = request.stop
    if request.tools:
        payload["tools"] = request.tools
    if request.tool_choice is not None:
        payload["tool_choice"] = request.tool_choice
    if request.response_format is not None:
        payload["response_format"] = response_format_payload(request.response_format)
    if request.extra_body:
        payload.update(request.extra_body)
    return payload


def embeddings_payload(request: EmbeddingRequest, *, model: str | None = None) -> dict[str, Any]:
    """The ``/v1/embeddings`` body ``request`` stands for: floats asked for, ``extra_body`` last."""
    payload: dict[str, Any] = {"input": request.input, "encoding_format": "float"}
    if model is not None:
        payload["model"] = model
    if request.dimensions is not None:
        payload["dimensions"] = request.dimensions
    if request.extra_body:
        payload.update(request.extra_body)
    return payload


def parse_embeddings(data: Any, expected: int, elapsed_ms: float | None = None) -> EmbeddingResponse:
    """An OpenAI embeddings answer (``{"data": [{"index", "embedding"}], "model", "usage"}``) as an
    EmbeddingResponse, the vectors in input order (``embedding`` as floats or as base64 little-endian float32).
    A ValueError when it does not hold ``expected`` vectors."""
    rows = sorted(data["data"], key=lambda row: int(row.get("index", 0)))
    if len(rows) != expected:
        raise ValueError(f"{len(rows)} vectors for {expected} inputs")
    vectors = [_vector(row["embedding"]) for row in rows]
    usage = data.get("usage") or {}
    return EmbeddingResponse(
        embeddings=vectors,
        model=data.get("model"),
        input_tokens=int(usage.get("prompt_tokens") or 0),
        completion_time_ms=elapsed_ms,
    )


def _vector(value: Any) -> list[float]:
    if isinstance(value, str):
        floats = array("f", base64.b64decode(value))
        if sys.byteorder == "big":
            floats.byteswap()
        return floats.tolist()
    if not isinstance(value, list):
        raise TypeError(f"an embedding is a list of floats or a base64 string, not {type(value).__name__}")
    return [float(x) for x in value]


def parse_retry_after(headers: Any) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (delta-seconds or HTTP-date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("Retry-After")
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or err.get("msg")
            if msg:
                return str(msg)
        elif isinstance(err, str):
            return err
        if "detail" in data:
            return str(data["detail"])
    return text[:500]


class OpenAICompatibleClient:
    """Async client for any ``/v1/chat/completions`` server (OpenAI, vLLM, our engine, Anthropic's compat API).

    One keep-alive connection pool per event loop, created lazily on first use, so the client may be built
    outside any loop and used from whichever loop runs it (a new loop gets a new pool).
    """

    def __init__(self, config: EndpointConfig, *, alias: str | None = None) -> None:
        self.config = config
        self.alias = alias
        self.base_url = resolve_base_url(config)
        self._url = f"{self.base_url}/chat/completions"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = config.resolved_api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=config.timeout)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"OpenAICompatibleClient({self.config.provider}/{self.config.model} at {self.base_url})"

    # -- session -----------------------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and self._loop is loop and not session.closed:
            return session
        if session is not None and self._loop is not loop:
            _discard_session(session, self._loop)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        self._loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close the connection pool (safe to call twice, or from another loop than the one that opened it)."""
        session, loop = self._session, self._loop
        self._session = None
        self._loop = None
        if session is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is running:
            await session.close()
        else:
            _discard_session(session, loop)

    async def __aenter__(self) -> OpenAICompatibleClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- requests ----------------------------------------------------------------------------------------------

    def build_payload(self, request: LLMRequest) -> dict[str, Any]:
        """The JSON body for ``request`` (``extra_body`` wins over everything else)."""
        return chat_payload(request, model=self.config.model)

    async def complete(self, request: LLMRequest) -> LLMResponse:
        """Send one chat request; raises RateLimitError, TransientError or ResourceError on failure."""
        raw, elapsed_ms = await self._post(self._url, self.build_payload(request))
        return self._parse(raw, elapsed_ms)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Send one ``/v1/embeddings`` request (floats asked for; a base64 answer is decoded too)."""
        url = f"{self.base_url}/embeddings"
        raw, elapsed_ms = await self._post(url, embeddings_payload(request, model=self.config.model))
        try:
            return parse_embeddings(_loads(raw), len(request.inputs()), elapsed_ms)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise TransientError(
                f"{self.base_url} returned unreadable embeddings ({exc}): {raw[:200]!r}", status=200, alias=self.alias
            ) from exc

    async def _post(self, url: str, payload: dict[str, Any]) -> tuple[bytes, float]:
        """POST ``payload`` to ``url``: the 200 answer's body and the milliseconds it took, or the error."""
        body = _dumps(payload)
        session = self._get_session()
        start = time.perf_counter()
        try:
            async with session.post(url, data=body, timeout=self._timeout) as resp:
                status = resp.status
                raw = await resp.read()
                if status != 200:
                    raise self._status_error(status, raw, resp.headers, url)
        except ResourceError:
            raise
        except TimeoutError as exc:  # aiohttp's timeouts subclass asyncio.TimeoutError (== TimeoutError)
            raise TransientError(
                f"request to {url} timed out after {self.config.timeout:g}s "
                "(raise the endpoint's timeout if the model is just slow)",
                alias=self.alias,
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise TransientError(
                f"cannot connect to {self.base_url}: {exc.os_error or exc}; is the server running?",
                alias=self.alias,
            ) from exc
        except aiohttp.ClientError as exc:
            raise TransientError(
                f"connection to {self.base_url} failed: {type(exc).__name__}: {exc}", alias=self.alias
            ) from exc
        return raw, (time.perf_counter() - start) * 1000.0

    def _status_error(self, status: int, raw: bytes, headers: Any, url: str) -> ResourceError:
        message = _error_message(raw)
        where = f"{self.config.provider}/{self.config.model}"
        if status == 429:
            return RateLimitError(
                f"{where} rate limited (429): {message}",
                retry_after=parse_retry_after(headers),
                alias=self.alias,
            )
        if status >= 500 or status in _TRANSIENT_4XX:
            return TransientError(f"{where} answered {status}: {message}", status=status, alias=self.alias)
        if status in (401, 403):
            return ResourceError(
                f"{where} refused the credentials ({status}): {message}; check the endpoint's api_key",
                status=status,
                alias=self.alias,
            )
        if status == 404:
            message += f" (POST {url}; check that base_url ends with the API root, e.g. '/v1')"
        return ResourceError(f"{where} answered {status}: {message}", status=status, alias=self.alias)

    def _parse(self, raw: bytes, elapsed_ms: float) -> LLMResponse:
        try:
            data = _loads(raw)
            choice = data["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            # A 200 with a body that is not a completion usually comes from a proxy glitch: worth a retry.
            raise TransientError(
                f"{self.base_url} returned an unreadable completion: {raw[:200]!r}", status=200, alias=self.alias
            ) from exc
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return LLMResponse(
            content=message.get("content") or "",
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=choice.get("finish_reason"),
            model=data.get("model"),
            reasoning=reasoning or None,
            tool_calls=message.get("tool_calls") or None,
            completion_time_ms=elapsed_ms,
        )


def _discard_session(session: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop | None) -> None:
    """Close a session that belongs to another event loop without awaiting on it."""
    if session.closed:
        return
    if loop is not None and loop.is_running() and not loop.is_closed():
        # Its loop lives on in another thread: close it there.
        asyncio.run_coroutine_threadsafe(session.close(), loop)
        return
    connector = session.connector
    if connector is not None:
        # The loop is closed (or idle): close the transports synchronously; nothing is left to await.
        connector._close()
