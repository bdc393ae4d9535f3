"""The backend interface: one way to start, stop, probe and stream from any generator of text.

A server (``app.serving``) talks only to a :class:`Backend`. A backend turns a :class:`GenerationRequest`
(a prompt or chat messages plus vLLM-style :class:`SamplingParams`) into a stream of :class:`GenerationChunk`
objects, each carrying the *increments* of every sample (text delta, token ids, logprobs, finish reason) and,
on the last one, the usage counts. Errors a client can fix are :class:`InvalidRequestError` (with the request
field at fault), a full queue is :class:`QueueFullError`, and a backend that cannot serve is
:class:`BackendUnavailableError`; the server maps them to OpenAI error bodies.
"""

from __future__ import annotations

import abc
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from app.engine.core.sampling_params import SamplingParams

T = TypeVar("T")

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "ClosingStream",
    "EngineStats",
    "GenerationChunk",
    "GenerationRequest",
    "HealthStatus",
    "InvalidRequestError",
    "ModelCard",
    "QueueFullError",
    "SequenceDelta",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "heartbeat_health",
]


# ---------------------------------------------------------------------------------------------- errors
class BackendError(Exception):
    """A failure the server reports as an OpenAI error body with ``status``."""

    status: int = 500
    type: str = "internal_server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        type: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if code is not None:
            self.code = code


class InvalidRequestError(BackendError):
    """The request cannot be served as given (bad prompt, too long, unknown option); HTTP 400."""

    status = 400
    type = "invalid_request_error"


class QueueFullError(BackendError):
    """The backend's bounded waiting queue is full; the client should retry later (HTTP 429)."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BackendUnavailableError(BackendError):
    """The backend is not running, crashed, or its upstream cannot be reached (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    code = "backend_unavailable"


# ---------------------------------------------------------------------------------------------- data
@dataclass
class GenerationRequest:
    """One prompt (text or token ids) or one chat conversation, to be sampled ``params.n`` times."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # OpenAI tool definitions for the chat template (left out with tool_choice "none")
    tools: list[dict[str, Any]] | None = None
    # The request field behind ``params.structured_outputs`` (response_format, tools, ...), for errors
    structured_param: str | None = None
    # Fields a proxy backend forwards upstream as the client sent them (response_format, structured_outputs,
    # guided_*, tool_choice, parallel_tool_calls); in-process backends read ``params`` instead
    upstream_fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a GenerationRequest needs exactly one of prompt or messages")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    token_id: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the ``top`` alternatives (best first)."""

    token: str
    logprob: float
    token_id: int | None = None
    top: tuple[TopLogprob, ...] = ()


@dataclass
class SequenceDelta:
    """What one sample (choice ``index``) produced since the previous chunk."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" on the sample's last delta
    stop_reason: int | str | None = None  # the stop string or token id that finished it, if any
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool-call deltas, from an upstream that parses them


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerationChunk:
    """One step of a request's stream. ``finished`` is set on the last chunk, which carries ``usage``."""

    request_id: str
    deltas: list[SequenceDelta]
    num_prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    finished: bool = False
    usage: Usage | None = None
    queue_time: float | None = None  # seconds waiting before the first schedule, when the backend knows
    # SamplingParams.capture, on the last chunk: {layer: [positions, hidden] float32 tensor} and the positions
    hidden_states: dict[int, Any] | None = None
    hidden_positions: list[int] | None = None


@dataclass(frozen=True)
class ModelCard:
    id: str
    created: int
    owned_by: str = "inf-engine"
    root: str | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class HealthStatus:
    ok: bool
    detail: str = "ok"


@dataclass(frozen=True)
class EngineStats:
    """A scrape-time snapshot for the vLLM-named Prometheus metrics (counters are cumulative)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # the prefix cache's eviction policy (None: the backend does not say, and no inf_engine_prefix_cache_*
    # series are exported) and the cached blocks it gave up for fresh ones ("capacity") or to its TTL
    eviction_policy: str | None = None
    prefix_cache_evictions: int = 0
    prefix_cache_expirations: int = 0
    # speculative decoding counters (exported only when it is on)
    spec_decode_enabled: bool = False
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


def heartbeat_health(
    *,
    alive: bool,
    has_work: bool,
    last_step: float | None,
    stall_seconds: float,
    now: float | None = None,
    work_since: float | None = None,
) -> HealthStatus:
    """The rule behind ``/health``: dead loop, or no step for ``stall_seconds`` while work waits → unhealthy.

    The stall clock starts at the later of the last step and ``work_since`` (when the engine last went from idle
    to having work): an engine that never made a step is caught once its first work waited that long, and one
    that sat idle for an hour is not blamed for the request that arrived a moment ago. ``last_step``,
    ``work_since`` and ``now`` are readings of one clock (``time.monotonic()`` unless the caller passes ``now``).
    """
    if not alive:
        return HealthStatus(False, "the engine loop is not running")
    marks = [t for t in (last_step, work_since) if t is not None]
    if has_work and marks:
        since = max(marks)
        idle = (time.monotonic() if now is None else now) - since
        if idle > stall_seconds:
            first = "" if last_step is not None and last_step >= since else " since its work arrived"
            return HealthStatus(
                False,
                f"the engine has work but made no step for {idle:.1f}s{first} "
                f"(the stall limit, INF_ENGINE_HEALTH_STALL_SECONDS, is {stall_seconds:g}s)",
            )
    return HealthStatus(True)


class ClosingStream(Generic[T]):
    """An async iterator whose ``aclose`` always runs ``on_close`` (once), even if iteration never began.

    An async generator that was never started skips its ``finally`` blocks when closed, so a request queued
    in ``generate`` but never iterated would keep running; wrapping the generator fixes that.
    """

    def __init__(self, inner: AsyncIterator[T], on_close: Callable[[], Awaitable[None] | None]) -> None:
        self._inner = inner
        self._on_close = on_close
        self._closed = False

    def __aiter__(self) -> ClosingStream[T]:
        return self

    async def __anext__(self) -> T:
        return await self._inner.__anext__()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            inner_close = getattr(self._inner, "aclose", None)
            if inner_close is not None:
                await inner_close()
        finally:
            result = self._on_close()
            if inspect.isawaitable(result):
                await result


# ---------------------------------------------------------------------------------------------- interface
class Backend(abc.ABC):
    """A source of completions. Subclasses register themselves by ``name`` (see ``registry``)."""

    name: ClassVar[str] = "backend"
    # Whether ``params.structured_outputs`` is honoured (constrained decoding, or forwarded upstream)
    supports_structured_outputs: ClassVar[bool] = False
    # activations and interventions on the residual stream (our engine only)
    supports_hidden_states: ClassVar[bool] = False
    # Whether tools are forwarded to an upstream server that reports ``tool_calls`` itself
    parses_tool_calls: ClassVar[bool] = False

    def __init__(self, *, served_model_name: str, max_model_len: int | None = None) -> None:
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        # an in-process engine's blocks and width, once started (what /v1/embeddings' pooling captures)
        self.num_hidden_layers: int | None = None
        self.hidden_size: int | None = None
        self.created = int(time.time())

    # -- lifecycle
    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model or start/connect to the server. Called once before serving."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release everything ``start`` acquired. Safe to call twice or without ``start``."""

    @abc.abstractmethod
    async def health(self) -> HealthStatus:
        """Whether the backend can serve now (cheap: called by every /health probe)."""

    async def models(self) -> list[ModelCard]:
        return [
            ModelCard(
                id=self.served_model_name,
                created=self.created,
                root=self.served_model_name,
                max_model_len=self.max_model_len,
            )
        ]

    # -- text
    @abc.abstractmethod
    async def tokenize(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a prompt, or of chat messages rendered with the model's template."""

    @abc.abstractmethod
    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of token ids."""

    # -- generation
    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Validate and enqueue ``request`` (raising :class:`BackendError` subclasses *here*, before any
        output), then return the stream of its chunks. Closing the stream early aborts the request."""

    async def abort(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Stop a request and free what it holds (streams also abort when closed)."""

    def stats(self) -> EngineStats | None:
        """Scheduler and cache gauges for /metrics, when the backend has them."""
        return None
