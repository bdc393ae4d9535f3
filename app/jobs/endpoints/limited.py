"""Endpoints called by workers: the ResourceManager with its per-process limits replaced by the global ones.

Every worker process has its own ResourceManager, so the per-process rate limiter and semaphore would let N
workers send N times an endpoint's ``rate_limit`` and ``max_concurrent``. Here each endpoint's client takes a
slot and a token from Redis (:class:`~app.jobs.limits.EndpointLimiter`, shared by all workers) around every
request, and reports 429s there, so one worker's 429 slows every worker at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits import EndpointLimiter, RateConfig, endpoint_id
from app.jobs.limits.slots import DEFAULT_LEASE_TTL_S
from app.pipeline.resources import ResourceConfig, ResourceManager
from app.pipeline.resources.client import LLMClient, create_client
from app.pipeline.resources.config import EndpointConfig
from app.pipeline.resources.errors import ConfigurationError, RateLimitError
from app.pipeline.resources.types import EmbeddingRequest, EmbeddingResponse, LLMRequest, LLMResponse

_Answer = TypeVar("_Answer", LLMResponse, EmbeddingResponse)

#: called with (endpoint id, seconds waited) after each request that had to wait for its slot or token
WaitHook = Callable[[str, float], None]


class LimitedClient:
    """An endpoint's client behind the endpoint's global limits."""

    def __init__(self, inner: LLMClient, limiter: EndpointLimiter, on_wait: WaitHook | None = None) -> None:
        self.inner = inner
        self.limiter = limiter
        self.on_wait = on_wait

    async def complete(self, request: LLMRequest) -> LLMResponse:
        return await self._limited(lambda: self.inner.complete(request))

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """An embeddings request under the same global slot and rate as the endpoint's chats."""
        embed = getattr(self.inner, "embed", None)
        if embed is None:
            raise ConfigurationError(f"{type(self.inner).__name__} does not serve embeddings")
        return await self._limited(lambda: embed(request))

    async def _limited(self, send: Callable[[], Awaitable[_Answer]]) -> _Answer:
        async with self.limiter.request() as permit:
            if permit.waited_s > 0 and self.on_wait is not None:
                self.on_wait(self.limiter.endpoint, permit.waited_s)
            try:
                response = await send()
            except RateLimitError as exc:
                await self.limiter.report(status=429, retry_after=exc.retry_after)
                raise
        await self.limiter.report(status=200)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
        await self.limiter.aclose()


class GloballyLimitedResources(ResourceManager):
    """A ResourceManager whose endpoints' ``rate_limit`` and ``max_concurrent`` hold across every worker.

    ``redis`` builds the asyncio Redis client on first use (it belongs to the event loop that calls it: the
    worker process's one loop).
    """

    def __init__(
        self,
        config: ResourceConfig,
        redis: Callable[[], AsyncRedis],
        *,
        prefix: str,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        on_wait: WaitHook | None = None,
    ) -> None:
        super().__init__(config)
        self._redis_factory = redis
        self._redis: AsyncRedis | None = None
        self._prefix = prefix
        self._lease_ttl_s = lease_ttl_s
        self._on_wait = on_wait
        self._limits: dict[int, EndpointConfig] = {}
        for endpoints in self._endpoints.values():
            for ep in endpoints:
                # the global limit replaces the per-process one (both would pace each request twice)
                self._limits[id(ep)] = ep.config
                if ep.config.rate_limit is not None or ep.config.max_concurrent is not None:
                    ep.config = ep.config.model_copy(update={"rate_limit": None, "max_concurrent": None})
                ep.limiter = None

    def _client(self, ep: Any) -> LLMClient:
        if ep.client is None:
            config = self._limits.get(id(ep), ep.config)
            inner = create_client(config, alias=ep.alias)
            if config.rate_limit is None and config.max_concurrent is None:
                ep.client = inner
            else:
                if self._redis is None:
                    self._redis = self._redis_factory()
                limiter = EndpointLimiter(
                    self._redis,
                    endpoint_id(config),
                    rate=RateConfig(rpm=config.rate_limit) if config.rate_limit is not None else None,
                    max_concurrent=config.max_concurrent,
                    prefix=self._prefix,
                    lease_ttl_s=self._lease_ttl_s,
                )
                ep.client = LimitedClient(inner, limiter, self._on_wait)
        client: LLMClient = ep.client
        return client

    async def aclose(self) -> None:
        await super().aclose()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
