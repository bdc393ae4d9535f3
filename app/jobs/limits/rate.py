"""Requests per minute for one endpoint, shared by every worker through Redis.

The in-process :class:`app.pipeline.resources.rate_limit.RateLimiter` paces one process; this one paces all of
them together, with the same knobs and meaning (``rpm``, ``max_tokens``, ``min_rpm``, ``recovery_factor``,
``backoff_factor``): the bucket starts with one token, a 429 halves the rate for every worker at once (at most once
per token interval) and blocks everybody until Retry-After has passed, and successes creep back toward ``rpm``.

A caller reserves its token in one round trip and sleeps until its turn (no polling). If a 429 lands while it
sleeps, its reservation is cancelled (the shared epoch moves) and it asks again at the new rate.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits.scripts import RATE_SCRIPT, LimitKeys

DEFAULT_PREFIX = "inf"
DEFAULT_IDLE_TTL_S = (
    3600.0  # state of an endpoint nobody called for this long is forgotten (back to full rate)
)


@dataclass(frozen=True, slots=True)
class RateConfig:
    """The knobs of one endpoint's limit; validated like the in-process RateLimiter's."""

    rpm: float
    max_tokens: float = 1.0
    min_rpm: float = 1.0
    recovery_factor: float = 1.1
    backoff_factor: float = 0.5
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S

    def __post_init__(self) -> None:
        if self.rpm <= 0:
            raise ValueError(f"rpm must be > 0 (requests per minute), got {self.rpm}")
        if self.min_rpm <= 0:
            raise ValueError(f"min_rpm must be > 0, got {self.min_rpm}")
        if self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be >= 1 (the bucket must hold one request), got {self.max_tokens}"
            )
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be between 0 and 1 (exclusive), got {self.backoff_factor}")
        if self.recovery_factor <= 1:
            raise ValueError(f"recovery_factor must be > 1, got {self.recovery_factor}")
        if self.idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {self.idle_ttl_s}")

    def argv(self, op: str, retry_after: float = 0.0) -> list[Any]:
        return [
            op,
            repr(float(self.rpm)),
            repr(float(self.max_tokens)),
            repr(float(self.min_rpm)),
            repr(float(self.recovery_factor)),
            repr(float(self.backoff_factor)),
            int(self.idle_ttl_s * 1000),
            repr(float(retry_after)),
        ]


@dataclass(frozen=True, slots=True)
class RateState:
    """A snapshot of the shared state (``peek``)."""

    current_rpm: float
    tokens: float  # negative: tokens already promised to sleeping callers
    blocked_for_s: float  # seconds until Retry-After has passed (0 when not blocked)
    epoch: int
    acquires: int
    hits: int  # 429s reported
    backoffs: int  # 429s that lowered the rate
    recoveries: int


@dataclass(slots=True)
class WaitStats:
    """What this instance (one worker process) spent waiting."""

    acquires: int = 0
    waits: int = 0
    total_wait_s: float = 0.0
    max_wait_s: float = 0.0
    cancelled_reservations: int = 0  # re-asked after a 429 cancelled a reservation

    def record(self, waited: float) -> None:
        self.acquires += 1
        if waited > 0:
            self.waits += 1
            self.total_wait_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)


def _parse_state(reply: list[Any]) -> RateState:
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
    return RateState(
        current_rpm=float(values[0]),
        tokens=float(values[1]),
        blocked_for_s=float(values[2]),
        epoch=int(values[3]),
        acquires=int(values[4]),
        hits=int(values[5]),
        backoffs=int(values[6]),
        recoveries=int(values[7]),
    )


def _pair(reply: list[Any]) -> tuple[float, int]:
    first, second = (v.decode() if isinstance(v, bytes) else str(v) for v in reply)
    return float(first), int(second)


def _retry_after(value: float | None) -> float:
    return float(value) if value is not None and value > 0 else 0.0


class GlobalRateLimiter:
    """Async, for worker code running on an event loop (``redis.asyncio``).

    ``GlobalRateLimiter(redis, "openai:gpt-4o", RateConfig(rpm=300), prefix="inf")``; every instance built with
    the same prefix and endpoint shares one limit, wherever it runs.
    """

    def __init__(
        self, redis: AsyncRedis, endpoint: str, config: RateConfig, *, prefix: str = DEFAULT_PREFIX
    ) -> None:
        self.redis = redis
        self.config = config
        self.keys = LimitKeys(prefix, endpoint)
        self._script = redis.register_script(RATE_SCRIPT)
        self.stats = WaitStats()

    async def _call(self, op: str, retry_after: float = 0.0) -> list[Any]:
        return list(await self._script(keys=[self.keys.rate], args=self.config.argv(op, retry_after)))

    async def acquire(self) -> float:
        """Wait for this worker's turn; returns the seconds spent waiting."""
        start = time.monotonic()
        slept = False
        while True:
            delay, epoch = _pair(await self._call("acquire"))
            if delay <= 0:
                break
            await asyncio.sleep(delay)
            slept = True
            current = await self.redis.hget(self.keys.rate, "epoch")  # type: ignore[misc]
            if current is None or int(current) == epoch:
                break
            self.stats.cancelled_reservations += 1  # a 429 landed while we slept: ask again at the new rate
        waited = time.monotonic() - start if slept else 0.0
        self.stats.record(waited)
        return waited

    async def backoff(self, retry_after: float | None = None) -> float:
        """Report a 429 (with the server's Retry-After in seconds, if any); returns the new shared rpm."""
        rpm, _ = _pair(await self._call("backoff", _retry_after(retry_after)))
        return rpm

    async def recover(self) -> float:
        """Report a success; returns the shared rpm after it."""
        rpm, _ = _pair(await self._call("recover"))
        return rpm

    async def peek(self) -> RateState:
        return _parse_state(await self._call("peek"))

    async def reset(self) -> None:
        """Forget the shared state (full rate, one token)."""
        await self.redis.delete(self.keys.rate)
