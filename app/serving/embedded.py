"""Our engine inside the pipeline's process: the client behind ``EndpointConfig("native", model)``.

The pipeline layer knows no engine; it reaches one through an ``LLMClient``. This module is that client for
the in-process engine, registered for provider ``"native"`` (endpoints *with* a ``base_url`` still go over
HTTP to ``inf-engine serve``). A request takes exactly the server's path: the same body
(``chat_payload``: ``response_format`` as OpenAI's ``json_schema``, ``tools``, ``tool_choice``), the same field
validation and constraint (``ChatCompletionRequest``, ``chat_generation_request``: the output decoded under
the schema or the tool calls' structure), chat template and length checks (``NativeBackend``), and the tool
calls read back as the route reads them (``chat_body``), so a pipeline answers the same in process as against
our server.

One engine per model and process: every endpoint and every client naming the same model share it, so the
calls a pipeline makes concurrently meet in one scheduler and are decoded together (continuous batching).
The weights (``LLMEngine``) load once; the asyncio side (``AsyncEngine``) belongs to one event loop and is
rebuilt over the same weights when a later ``asyncio.run`` uses the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from app.pipeline.resources import (
    ConfigurationError,
    EndpointConfig,
    LLMClient,
    LLMRequest,
    LLMResponse,
    RateLimitError,
    ResourceConfig,
    ResourceError,
    TransientError,
    chat_payload,
    register_client_factory,
)
from app.serving.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    GenerationRequest,
    QueueFullError,
)
from app.serving.backends.local import default_served_name
from app.serving.chat import chat_body
from app.serving.errors import APIError
from app.serving.openai_serving import chat_generation_request
from app.serving.responses import Choice, collect
from app.serving.schemas import ChatCompletionRequest
from app.serving.tools import ToolPlan

if TYPE_CHECKING:
    from app.engine.llm_engine import LLMEngine
    from app.serving.backends.native import NativeBackend

__all__ = [
    "PROVIDER",
    "EmbeddedEngine",
    "EmbeddedEngineClient",
    "embedded_engines",
    "embedded_resources",
    "get_embedded_engine",
    "register_embedded_engine",
]

PROVIDER = "native"
# Names that mean "the default model" in EndpointConfig.model (it must be non-empty).
_DEFAULT_NAMES = frozenset({"default", "smollm2", "smollm2-135m-instruct"})


def _default_model_name() -> str:
    from app.engine.loading import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def resolve_model(model: str | None) -> str | None:
    """The checkpoint ``model`` names: ``None`` for the default SmolLM2, else an existing folder or file."""
    if model is None or model.strip().lower() in _DEFAULT_NAMES:
        return None
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigurationError(
            f"native endpoint model {model!r} is neither {_default_model_name()!r} (the default model) nor an "
            "existing Hugging Face folder or .gguf file; the in-process engine never downloads weights"
        )
    return str(path.resolve())


class EmbeddedEngine:
    """One model's engine, shared by every client in the process that names that model.

    ``backend()`` returns a started :class:`NativeBackend` bound to the running event loop: the weights load
    on first use (on a worker thread, once, whichever loop asks), and a new loop gets a fresh ``AsyncEngine``
    over the same ``LLMEngine``. Clients hold a reference; when the last one closes, the loop-side engine
    stops (the weights stay loaded for the next run).
    """

    def __init__(self, model: str | None, engine_options: dict[str, Any] | None = None) -> None:
        self.model = model
        self.engine_options = dict(engine_options or {})
        self._load_lock = threading.Lock()
        self._loading: concurrent.futures.Future[LLMEngine] | None = None
        self._backend: NativeBackend | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._users = 0

    def __repr__(self) -> str:
        return f"EmbeddedEngine({self.model or _default_model_name()!r}, users={self._users})"

    @property
    def async_engine(self) -> Any:
        """The current ``AsyncEngine`` (None before the first request), for stats and tests."""
        return None if self._backend is None else self._backend.engine

    @property
    def started_backend(self) -> NativeBackend | None:
        """The loop-side backend once the first request built it (None before), for an engine worker's /metrics;
        its counters keep their values after its loop ended."""
        return self._backend

    # -- weights -----------------------------------------------------------------------------------------------

    def _load(self) -> LLMEngine:
        from app.engine.llm_engine import LLMEngine

        # No waiting queue bound: the pipeline's scheduler already limits what is in flight.
        options = {"max_waiting": None, **self.engine_options}
        return LLMEngine(self.model, **options)

    async def _weights(self) -> LLMEngine:
        # A concurrent.futures future, not an asyncio one: callers on any loop (or thread) share one load.
        with self._load_lock:
            if self._loading is None or (self._loading.done() and self._loading.exception() is not None):
                self._loading = concurrent.futures.Future()
                threading.Thread(target=self._load_into, args=(self._loading,), daemon=True).start()
            loading = self._loading
        return await asyncio.wrap_future(loading)

    def _load_into(self, future: concurrent.futures.Future[LLMEngine]) -> None:
        try:
            future.set_result(self._load())
        except BaseException as exc:  # surfaced to every waiting caller
            future.set_exception(exc)

    # -- the loop side -----------------------------------------------------------------------------------------

    async def backend(self) -> NativeBackend:
        """A started backend for the running loop (loads the model on first use)."""
        loop = asyncio.get_running_loop()
        backend = self._ready(loop)
        if backend is not None:
            return backend
        try:
            weights = await self._weights()
        except FileNotFoundError as exc:
            raise ConfigurationError(f"cannot load the in-process engine's model: {exc}") from None
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())  # asyncio locks belong to one loop
        async with self._lock[1]:
            backend = self._ready(loop)  # another caller may have built it while we waited
            if backend is not None:
                return backend
            return await self._rebuild(weights, loop)

    def _ready(self, loop: asyncio.AbstractEventLoop) -> NativeBackend | None:
        backend = self._backend
        if backend is None or self._loop is not loop or backend.engine is None:
            return None
        return backend if backend.engine.is_running else None

    async def _rebuild(self, weights: LLMEngine, loop: asyncio.AbstractEventLoop) -> NativeBackend:
        from app.engine.async_engine import AsyncEngine
        from app.serving.backends.native import NativeBackend

        old = self._backend
        if old is not None and old.engine is not None:
            if old.engine.is_running:
                raise ResourceError(
                    f"the in-process engine for {self.model or _default_model_name()} is serving another event "
                    "loop; one engine per process serves one loop at a time (run the pipelines in one loop)"
                )
            # Its loop ended (or it failed): abort what it left in the engine and free its step thread.
            await old.engine.shutdown()
        backend = NativeBackend(
            engine=AsyncEngine(weights),
            served_model_name=default_served_name(self.model, weights.config.served_model_name),
        )
        await backend.start()
        self._backend, self._loop = backend, loop
        return backend

    def acquire(self) -> None:
        self._users += 1

    async def release(self) -> None:
        """Drop one client's reference; the last one stops the loop-side engine (not the weights)."""
        self._users = max(0, self._users - 1)
        if self._users or self._backend is None or self._backend.engine is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            await self._backend.engine.shutdown()
            self._loop = None


_ENGINES: dict[str | None, EmbeddedEngine] = {}
_ENGINES_LOCK = threading.Lock()


def get_embedded_engine(model: str | None = None, **engine_options: Any) -> EmbeddedEngine:
    """The process's shared engine for ``model`` (None or ``"SmolLM2-135M-Instruct"``: the default model).

    ``engine_options`` (``LLMEngine`` keywords such as ``num_threads``) apply when this call creates it.
    """
    key = resolve_model(model)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = EmbeddedEngine(key, engine_options)
        return engine


def embedded_engines() -> list[EmbeddedEngine]:
    """The engines this process hosts (one per model named so far)."""
    with _ENGINES_LOCK:
        return list(_ENGINES.values())


class EmbeddedEngineClient(LLMClient):
    """The pipeline's ``LLMClient`` for an in-process engine: chat requests in, ``LLMResponse`` out."""

    def __init__(
        self, config: EndpointConfig, *, engine: EmbeddedEngine | None = None, alias: str | None = None
    ) -> None:
        self.config = config
        self.alias = alias
        self.engine = engine if engine is not None else get_embedded_engine(config.model)
        self.engine.acquire()
        self._closed = False

    def __repr__(self) -> str:
        return f"EmbeddedEngineClient({self.config.model!r})"

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.engine.release()

    def _chat_request(self, request: LLMRequest) -> ChatCompletionRequest:
        # The body an HTTP client would send (response_format, tools and tool_choice included), checked by the
        # server's own rules: a 400 there is one here.
        try:
            return ChatCompletionRequest.model_validate(chat_payload(request))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "request"
            raise self._error(f"invalid request field {where}: {first['msg']}", 400) from None
        except ValueError as exc:  # a response_format pydantic cannot describe
            raise self._error(f"invalid request (response_format): {exc}", 400) from None

    def _generation_request(
        self, body: ChatCompletionRequest, backend: Backend
    ) -> tuple[GenerationRequest, ToolPlan | None]:
        # The route's own path: sampling params, the constraint of response_format / structured_outputs / tools
        # (refused by a backend without structured outputs), the tools in the prompt, the fields a proxy forwards.
        try:
            return chat_generation_request(backend, f"pipeline-{uuid.uuid4().hex}", body)
        except APIError as exc:
            raise self._error(f"invalid request ({exc.param or 'request'}): {exc.message}", 400) from None

    def _error(self, message: str, status: int) -> ResourceError:
        return ResourceError(f"{PROVIDER}/{self.config.model}: {message}", status=status, alias=self.alias)

    async def complete(self, request: LLMRequest) -> LLMResponse:
        """Run one chat request through the engine; errors map to the scheduler's ResourceError classes."""
        body = self._chat_request(request)
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout):
                return await self._run(body, start)
        except TimeoutError:
            raise TransientError(
                f"{PROVIDER}/{self.config.model} took longer than {self.config.timeout:g}s "
                "(raise the endpoint's timeout, or lower max_tokens)",
                alias=self.alias,
            ) from None

    async def _run(self, body: ChatCompletionRequest, start: float) -> LLMResponse:
        backend = await self.engine.backend()
        generation, plan = self._generation_request(body, backend)
        try:
            stream = await backend.generate(generation)
        except QueueFullError as exc:
            raise RateLimitError(f"{PROVIDER}/{self.config.model}: {exc.message}", alias=self.alias) from None
        except BackendUnavailableError as exc:
            raise self._error(f"the in-process engine is down: {exc.message}", exc.status) from None
        except BackendError as exc:
            raise self._error(f"{exc.message} (param {exc.param})" if exc.param else exc.message, exc.status) from None
        # every sample is collected (n > 1); an LLMResponse carries the first one only
        choices = [Choice() for _ in range(generation.params.n)]
        first_token_ms: float | None = None
        prompt_tokens = completion_tokens = 0
        queue_time: float | None = None
        try:
            async for chunk in stream:
                if chunk.queue_time is not None and queue_time is None:
                    queue_time = chunk.queue_time
                if first_token_ms is None and any(d.index == 0 and (d.text or d.token_ids) for d in chunk.deltas):
                    first_token_ms = (time.perf_counter() - start) * 1000.0
                collect(choices, chunk, 0)
                if chunk.usage is not None:
                    prompt_tokens = chunk.usage.prompt_tokens
                    completion_tokens = chunk.usage.completion_tokens
        except BackendUnavailableError as exc:
            raise self._error(f"the in-process engine failed: {exc.message}", exc.status) from None
        finally:
            closer = getattr(stream, "aclose", None)  # a ClosingStream: aborts the request if unfinished
            if closer is not None:
                await closer()
        answer = _first_choice(choices, plan)
        message = answer["message"]
        return LLMResponse(
            content=message.get("content") or "",
            input_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            finish_reason=answer["finish_reason"],
            model=backend.served_model_name,
            tool_calls=message.get("tool_calls") or None,
            time_to_first_token_ms=first_token_ms,
            completion_time_ms=(time.perf_counter() - start) * 1000.0,
        )


def _first_choice(choices: list[Choice], plan: ToolPlan | None) -> dict[str, Any]:
    """The first choice as the route answers it: tool calls read out of the text (or an upstream's passed on),
    ``content`` None beside calls, and finish reason ``tool_calls`` when the model called and stopped."""
    parser = plan.parser if plan is not None else lambda: None
    body = chat_body({}, choices[:1], {}, False, parser)
    first: dict[str, Any] = body["choices"][0]
    return first


def register_embedded_engine(**engine_options: Any) -> None:
    """Serve ``native`` endpoints without a ``base_url`` with the in-process engine.

    ``engine_options`` (e.g. ``num_threads=2``) are ``LLMEngine`` keywords for engines created from now on.
    """

    def factory(config: EndpointConfig) -> LLMClient:
        return EmbeddedEngineClient(config, engine=get_embedded_engine(config.model, **engine_options))

    register_client_factory(PROVIDER, factory)


def embedded_resources(aliases: list[str] | tuple[str, ...], model: str | None = None) -> ResourceConfig:
    """A ResourceConfig sending every alias to the in-process engine of ``model`` (default: SmolLM2)."""
    name = model if model is not None else _default_model_name()
    resolve_model(name)  # fail now, with the config error, rather than on the first call
    return ResourceConfig({alias: EndpointConfig(PROVIDER, name) for alias in aliases})
