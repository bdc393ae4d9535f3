"""The resource manager: turns an alias into a paced, bounded, load-balanced call to one of its endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from app.pipeline.resources.client import LLMClient, create_client
from app.pipeline.resources.config import EndpointConfig, ResourceConfig
from app.pipeline.resources.errors import ConfigurationError, RateLimitError, ResourceError
from app.pipeline.resources.rate_limit import RateLimiter
from app.pipeline.resources.types import EmbeddingRequest, EmbeddingResponse, LLMRequest, LLMResponse

#: what a call returns (an LLMResponse or an EmbeddingResponse)
_Answer = TypeVar("_Answer", LLMResponse, EmbeddingResponse)


@dataclass
class ResourceMetrics:
    """Counters for one alias (or one endpoint). ``requests == successes + failures``; ``rate_limited`` (429s)
    is a subset of ``failures``. Latencies are of successful calls, in milliseconds, excluding queueing."""

    requests: int = 0
    successes: int = 0
    failures: int = 0
    rate_limited: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    total_latency_ms: float = 0.0
    min_latency_ms: float | None = None
    max_latency_ms: float | None = None
    total_queue_ms: float = 0.0

    @property
    def avg_latency_ms(self) -> float | None:
        return self.total_latency_ms / self.successes if self.successes else None

    @property
    def success_rate(self) -> float:
        """Successes over finished requests (0.0 before any request finished)."""
        return self.successes / self.requests if self.requests else 0.0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def record_success(self, latency_ms: float, input_tokens: int, output_tokens: int, queue_ms: float) -> None:
        self.requests += 1
        self.successes += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.total_latency_ms += latency_ms
        self.total_queue_ms += queue_ms
        if self.min_latency_ms is None or latency_ms < self.min_latency_ms:
            self.min_latency_ms = latency_ms
        if self.max_latency_ms is None or latency_ms > self.max_latency_ms:
            self.max_latency_ms = latency_ms

    def record_failure(self, rate_limited: bool = False, queue_ms: float = 0.0) -> None:
        self.requests += 1
        self.failures += 1
        self.total_queue_ms += queue_ms
        if rate_limited:
            self.rate_limited += 1

    def merge(self, other: ResourceMetrics) -> ResourceMetrics:
        """A new record adding ``other`` to this one."""
        mins = [m for m in (self.min_latency_ms, other.min_latency_ms) if m is not None]
        maxs = [m for m in (self.max_latency_ms, other.max_latency_ms) if m is not None]
        return ResourceMetrics(
            requests=self.requests + other.requests,
            successes=self.successes + other.successes,
            failures=self.failures + other.failures,
            rate_limited=self.rate_limited + other.rate_limited,
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            total_latency_ms=self.total_latency_ms + other.total_latency_ms,
            min_latency_ms=min(mins) if mins else None,
            max_latency_ms=max(maxs) if maxs else None,
            total_queue_ms=self.total_queue_ms + other.total_queue_ms,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "successes": self.successes,
            "failures": self.failures,
            "rate_limited": self.rate_limited,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "success_rate": self.success_rate,
            "min_latency_ms": self.min_latency_ms,
            "avg_latency_ms": self.avg_latency_ms,
            "max_latency_ms": self.max_latency_ms,
            "total_queue_ms": self.total_queue_ms,
        }


class _Endpoint:
    """Runtime state of one configured endpoint. Holds nothing bound to an event loop until it is used."""

    def __init__(self, alias: str, index: int, config: EndpointConfig) -> None:
        self.alias = alias
        self.index = index
        self.config = config
        self.client: LLMClient | None = None
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit else None
        self.metrics = ResourceMetrics()
        self.pending = 0  # picked and not finished (queued or in flight): what least_loaded balances
        self.active = 0  # inside client.complete
        self.blocked_until = 0.0  # Retry-After for endpoints without a limiter (time.monotonic)
        # One semaphore per event loop: asyncio primitives must not cross loops.
        self._semaphores: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = {}

    def semaphore(self) -> asyncio.Semaphore | None:
        limit = self.config.max_concurrent
        if limit is None:
            return None
        loop = asyncio.get_running_loop()
        entry = self._semaphores.get(id(loop))
        if entry is not None and entry[0] is loop:
            return entry[1]
        for key, (old, _) in list(self._semaphores.items()):
            if old.is_closed():
                del self._semaphores[key]
        sem = asyncio.Semaphore(limit)
        self._semaphores[id(loop)] = (loop, sem)
        return sem

    def cost(self) -> float:
        m, c = self.metrics, self.config
        return (m.input_tokens * c.input_cost_per_1m + m.output_tokens * c.output_cost_per_1m) / 1_000_000


class ResourceManager:
    """Clients, concurrency limits, rate limiters, load balancing and metrics for every configured alias.

    ``await manager.complete(alias, request)``: pick an endpoint of the alias, take a concurrency slot
    (``max_concurrent``), wait for the endpoint's rate limiter (``rate_limit`` rpm), call it, record metrics.
    ``await manager.embed(alias, EmbeddingRequest)`` does the same for ``/v1/embeddings`` (an ``Embedding`` call).
    A 429 slows the limiter down for every caller and honours Retry-After; errors are re-raised for the scheduler,
    which owns retries. Nothing here is tied to one event loop, so a manager can serve several ``asyncio.run``s.
    """

    def __init__(
        self, config: ResourceConfig | Mapping[str, Any] | None = None, *, seed: int | None = None
    ) -> None:
        if config is None:
            config = ResourceConfig({})
        elif not isinstance(config, ResourceConfig):
            if not isinstance(config, Mapping):
                raise ConfigurationError(
                    f"ResourceManager needs a ResourceConfig or a dict of endpoints, got {type(config).__name__}"
                )
            config = ResourceConfig.from_dict(config)
        self._config = config
        self._endpoints: dict[str, list[_Endpoint]] = {
            alias: [_Endpoint(alias, i, c) for i, c in enumerate(eps)] for alias, eps in config.items()
        }
        self._rr: dict[str, int] = dict.fromkeys(self._endpoints, 0)
        self._random = random.Random(seed)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ResourceManager:
        return cls(ResourceConfig.from_file(path))

    def __repr__(self) -> str:
        return f"ResourceManager(aliases={self.aliases()}, load_balancing={self._config.load_balancing!r})"

    # -- configuration -----------------------------------------------------------------------------------------

    @property
    def config(self) -> ResourceConfig:
        return self._config

    def has_alias(self, alias: str) -> bool:
        return alias in self._endpoints

    def aliases(self) -> list[str]:
        return list(self._endpoints)

    def _alias(self, alias: str) -> list[_Endpoint]:
        try:
            return self._endpoints[alias]
        except KeyError:
            known = ", ".join(repr(a) for a in self._endpoints) or "none"
            raise ConfigurationError(
                f"no endpoint is configured for alias {alias!r} (configured aliases: {known}); "
                f"add it to the resources, e.g. {{{alias!r}: EndpointConfig('openai', 'gpt-4o-mini')}}"
            ) from None

    def endpoints(self, alias: str) -> list[EndpointConfig]:
        return [e.config for e in self._alias(alias)]

    def max_retries(self, alias: str) -> int:
        """How often the scheduler may retry a call to ``alias`` (the largest of its endpoints' settings)."""
        return max(e.config.max_retries for e in self._alias(alias))

    def rate_limiters(self, alias: str) -> list[RateLimiter | None]:
        """Each endpoint's limiter (None where the endpoint has no ``rate_limit``)."""
        return [e.limiter for e in self._alias(alias)]

    def active(self, alias: str) -> int:
        """Requests to ``alias`` on the wire right now."""
        return sum(e.active for e in self._alias(alias))

    def waiting(self, alias: str) -> int:
        """Requests to ``alias`` waiting for a concurrency slot or a rate-limit token."""
        return sum(e.pending - e.active for e in self._alias(alias))

    # -- calls -------------------------------------------------------------------------------------------------

    def _pick(self, alias: str) -> _Endpoint:
        eps = self._alias(alias)
        if len(eps) == 1:
            return eps[0]
        strategy = self._config.load_balancing
        if strategy == "random":
            return self._random.choice(eps)
        start = self._rr[alias]
        self._rr[alias] = (start + 1) % len(eps)
        if strategy == "round_robin":
            return eps[start]
        # least_loaded: fewest queued-or-in-flight requests; ties go round-robin so load still spreads.
        n = len(eps)
        return min((eps[(start + k) % n] for k in range(n)), key=lambda e: e.pending)

    def _client(self, ep: _Endpoint) -> LLMClient:
        if ep.client is None:
            ep.client = create_client(ep.config, alias=ep.alias)
        return ep.client

    async def complete(
        self, alias: str, request: LLMRequest, *, on_ready: Callable[[], None] | None = None
    ) -> LLMResponse:
        """Run one request against an endpoint of ``alias``; raises the client's ResourceError subclasses.
        ``on_ready`` is called when the slot and rate token are held and the request leaves (profiling waits)."""
        return await self._call(alias, lambda client: client.complete(request), on_ready)

    async def embed(
        self, alias: str, request: EmbeddingRequest, *, on_ready: Callable[[], None] | None = None
    ) -> EmbeddingResponse:
        """One ``/v1/embeddings`` request to an endpoint of ``alias``, under the same slots, rate limits, 429
        handling and metrics as :meth:`complete` (its input tokens count; it generates none)."""

        def send(client: LLMClient) -> Awaitable[EmbeddingResponse]:
            embed = getattr(client, "embed", None)
            if embed is None:
                raise ConfigurationError(
                    f"the endpoint of alias {alias!r} ({type(client).__name__}) does not serve embeddings; map "
                    "the alias to an OpenAI-compatible endpoint with /v1/embeddings (openai, vllm, our server)"
                )
            answer: Awaitable[EmbeddingResponse] = embed(request)
            return answer

        return await self._call(alias, send, on_ready)

    async def _call(
        self, alias: str, send: Callable[[LLMClient], Awaitable[_Answer]], on_ready: Callable[[], None] | None
    ) -> _Answer:
        ep = self._pick(alias)
        client = self._client(ep)
        ep.pending += 1
        queued = time.perf_counter()
        sem = ep.semaphore()
        try:
            if sem is not None:
                await sem.acquire()
            try:
                # The slot first, then the token: the request leaves right after its token, so the rate seen by
                # the server is the limiter's rate even when requests queue for slots.
                if ep.limiter is not None:
                    await ep.limiter.acquire()
                elif ep.blocked_until:
                    delay = ep.blocked_until - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                start = time.perf_counter()
                queue_ms = (start - queued) * 1000.0
                if on_ready is not None:
                    on_ready()
                ep.active += 1
                try:
                    response = await send(client)
                except RateLimitError as exc:
                    if exc.alias is None:
                        exc.alias = alias
                    if ep.limiter is not None:
                        ep.limiter.backoff(exc.retry_after)
                    elif exc.retry_after:
                        ep.blocked_until = max(ep.blocked_until, time.monotonic() + exc.retry_after)
                    ep.metrics.record_failure(rate_limited=True, queue_ms=queue_ms)
                    raise
                except Exception as exc:
                    if isinstance(exc, ResourceError) and exc.alias is None:
                        exc.alias = alias
                    ep.metrics.record_failure(queue_ms=queue_ms)
                    raise
                finally:
                    ep.active -= 1
            finally:
                if sem is not None:
                    sem.release()
        finally:
            ep.pending -= 1
        latency_ms = (time.perf_counter() - start) * 1000.0
        output_tokens = int(getattr(response, "output_tokens", 0) or 0)
        ep.metrics.record_success(latency_ms, response.input_tokens, output_tokens, queue_ms)
        if ep.limiter is not None:
            ep.limiter.recover()
        response.queue_time_ms = queue_ms
        if response.completion_time_ms is None:
            response.completion_time_ms = latency_ms
        return response

    # -- metrics -----------------------------------------------------------------------------------------------

    @overload
    def metrics(self, alias: str) -> ResourceMetrics: ...

    @overload
    def metrics(self, alias: None = None) -> dict[str, ResourceMetrics]: ...

    def metrics(self, alias: str | None = None) -> ResourceMetrics | dict[str, ResourceMetrics]:
        """A snapshot: one alias's metrics, or ``{alias: metrics}`` for all."""
        if alias is not None:
            total = ResourceMetrics()
            for ep in self._alias(alias):
                total = total.merge(ep.metrics)
            return total
        return {a: self.metrics(a) for a in self._endpoints}

    def endpoint_metrics(self, alias: str) -> list[ResourceMetrics]:
        """A snapshot per endpoint of ``alias``, in configuration order."""
        return [dataclasses.replace(ep.metrics) for ep in self._alias(alias)]

    def estimate_cost(self, config: EndpointConfig | str | None = None) -> float:
        """Dollars spent so far from recorded tokens and per-1M prices: all endpoints (None), one alias (str),
        or one endpoint (an EndpointConfig of this manager; matched by identity, else by equality)."""
        every = [ep for eps in self._endpoints.values() for ep in eps]
        if config is None:
            chosen = every
        elif isinstance(config, str):
            chosen = self._alias(config)
        else:
            chosen = [ep for ep in every if ep.config is config] or [ep for ep in every if ep.config == config]
        return sum(ep.cost() for ep in chosen)

    def reset_metrics(self) -> None:
        for eps in self._endpoints.values():
            for ep in eps:
                ep.metrics = ResourceMetrics()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close every client's connections (the manager can be used again afterwards; clients reopen)."""
        for eps in self._endpoints.values():
            for ep in eps:
                client, ep.client = ep.client, None
                if client is not None:
                    await client.aclose()

    async def __aenter__(self) -> ResourceManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
