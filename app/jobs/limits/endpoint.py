"""Both limits of one endpoint together, as a worker uses them around each request.

    limiter = EndpointLimiter.for_endpoint(redis, config, prefix=settings.redis_prefix)
    async with limiter.request():          # a slot (max concurrency), then a token (requests per minute)
        response = await call_endpoint()
    await limiter.report(status=response.status, retry_after=...)   # 429 slows every worker; 2xx recovers

The slot is taken before the token: a worker that waits for a slot must not sit on a token meanwhile, or the
tokens would bunch up and leave as a burst.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits.rate import DEFAULT_PREFIX, GlobalRateLimiter, RateConfig
from app.jobs.limits.slots import DEFAULT_LEASE_TTL_S, ConcurrencySlots, SlotLease
from app.pipeline.resources.config import EndpointConfig


def endpoint_id(config: EndpointConfig) -> str:
    """The name under which every worker finds one endpoint's limits: provider, model and where it is served.

    Two aliases pointing at the same server and model share one limit, as the server sees one client.
    """
    where = (config.base_url or "local").rstrip("/")
    return f"{config.provider}:{config.model}@{where}"


@dataclass(slots=True)
class Permit:
    """What ``EndpointLimiter.request()`` yields: the seconds spent waiting and the slot held (if limited)."""

    waited_s: float
    lease: SlotLease | None


class EndpointLimiter:
    """Requests per minute and max concurrency of one endpoint, shared by all workers (either may be None)."""

    def __init__(
        self,
        redis: AsyncRedis,
        endpoint: str,
        *,
        rate: RateConfig | None = None,
        max_concurrent: int | None = None,
        prefix: str = DEFAULT_PREFIX,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self.endpoint = endpoint
        self.rate = GlobalRateLimiter(redis, endpoint, rate, prefix=prefix) if rate is not None else None
        self.slots = (
            ConcurrencySlots(redis, endpoint, max_concurrent, prefix=prefix, lease_ttl_s=lease_ttl_s)
            if max_concurrent is not None
            else None
        )

    @classmethod
    def for_endpoint(
        cls, redis: AsyncRedis, config: EndpointConfig, *, prefix: str = DEFAULT_PREFIX, **rate_knobs: float
    ) -> EndpointLimiter:
        """Limits from an ``EndpointConfig`` (``rate_limit`` rpm, ``max_concurrent``); knobs as in RateConfig."""
        rate = RateConfig(rpm=config.rate_limit, **rate_knobs) if config.rate_limit is not None else None
        return cls(redis, endpoint_id(config), rate=rate, max_concurrent=config.max_concurrent, prefix=prefix)

    @contextlib.asynccontextmanager
    async def request(self, slot_timeout: float | None = None) -> AsyncIterator[Permit]:
        if self.slots is None:
            yield Permit(await self.rate.acquire() if self.rate is not None else 0.0, None)
            return
        async with self.slots.slot(slot_timeout) as lease:
            waited = lease.waited_s
            if self.rate is not None:
                waited += await self.rate.acquire()
            yield Permit(waited, lease)

    async def report(self, *, status: int | None, retry_after: float | None = None) -> None:
        """Feed back one response: 429 lowers the shared rate (and honours Retry-After); a success recovers it."""
        if self.rate is None or status is None:
            return
        if status == 429:
            await self.rate.backoff(retry_after)
        elif 200 <= status < 300:
            await self.rate.recover()

    async def aclose(self) -> None:
        if self.slots is not None:
            await self.slots.aclose()
