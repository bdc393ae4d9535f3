"""An adaptive async token bucket: paces requests to an endpoint and backs off on 429s."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]

_EPS = 1e-9  # seconds / tokens: float noise below this is "now" (a fake clock could otherwise spin forever)


@dataclass(slots=True)
class RateLimiterStats:
    """Counters kept by a :class:`RateLimiter`."""

    acquires: int = 0  # tokens handed out
    waits: int = 0  # acquires that had to wait
    total_wait_s: float = 0.0
    max_wait_s: float = 0.0
    hits: int = 0  # backoff() calls, i.e. 429s reported
    backoffs: int = 0  # backoff() calls that actually lowered the rate
    recoveries: int = 0  # recover() calls that actually raised the rate

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class RateLimiter:
    """Token bucket refilled at ``rpm / 60`` tokens per second, holding at most ``max_tokens`` (default 1).

    * ``await acquire()`` takes one token, waiting if needed; waiters are served first in, first out, and only
      the head of the queue sleeps (the rest wait on a future), so there is no polling.
    * The bucket starts with one token, so a fresh limiter never bursts: N requests take (N-1) * 60/rpm seconds.
    * ``backoff(retry_after)`` multiplies the rate by ``backoff_factor`` (floored at ``min_rpm``) and, when the
      server said Retry-After, lets nobody through before then. A flood of 429s from requests that were already in
      flight counts as one signal: the rate drops at most once per token interval.
    * ``recover()`` multiplies the rate by ``recovery_factor`` (capped at ``rpm``), at most once per token interval,
      so a burst of successes cannot undo a backoff at once.

    ``clock`` and ``sleep`` are injectable so that tests can drive time by hand.
    """

    def __init__(
        self,
        rpm: float,
        max_tokens: float | None = None,
        min_rpm: float = 1.0,
        recovery_factor: float = 1.1,
        backoff_factor: float = 0.5,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if rpm <= 0:
            raise ValueError(f"rpm must be > 0 (requests per minute), got {rpm}")
        if min_rpm <= 0:
            raise ValueError(f"min_rpm must be > 0, got {min_rpm}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (the bucket must hold one request), got {max_tokens}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be between 0 and 1 (exclusive), got {backoff_factor}")
        if recovery_factor <= 1:
            raise ValueError(f"recovery_factor must be > 1, got {recovery_factor}")
        self.rpm = float(rpm)
        self.min_rpm = min(float(min_rpm), self.rpm)
        self.max_tokens = float(max_tokens) if max_tokens is not None else 1.0
        self.recovery_factor = recovery_factor
        self.backoff_factor = backoff_factor
        self._clock = clock
        self._sleep = sleep
        self._rate = self.rpm / 60.0  # tokens per second
        self._tokens = 1.0
        self._last = clock()
        self._blocked_until = 0.0
        self._last_change = float("-inf")
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.stats = RateLimiterStats()

    # -- state -------------------------------------------------------------------------------------------------

    @property
    def current_rpm(self) -> float:
        return self._rate * 60.0

    @property
    def interval(self) -> float:
        """Seconds between tokens at the current rate."""
        return 1.0 / self._rate

    @property
    def blocked_until(self) -> float:
        """Clock time before which nobody acquires (after a Retry-After)."""
        return self._blocked_until

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _refill(self, now: float) -> None:
        elapsed = now - self._last
        if elapsed > 0:
            self._tokens = min(self.max_tokens, self._tokens + elapsed * self._rate)
            self._last = now

    def _delay(self, now: float) -> float:
        """Seconds until a token may be taken (<= _EPS: now)."""
        self._refill(now)
        delay = (1.0 - self._tokens) / self._rate if self._tokens < 1.0 - _EPS else 0.0
        return max(delay, self._blocked_until - now)

    # -- acquire -----------------------------------------------------------------------------------------------

    async def acquire(self) -> float:
        """Wait for a token; returns the seconds spent waiting."""
        start = self._clock()
        if not self._waiters and self._delay(start) <= _EPS:
            self._take(start, 0.0)
            return 0.0
        loop = asyncio.get_running_loop()
        me: asyncio.Future[None] = loop.create_future()
        self._waiters.append(me)
        if len(self._waiters) == 1:
            me.set_result(None)  # head of the queue straight away
        target: float | None = None
        try:
            await me  # resolved when this waiter reaches the head
            while True:
                now = self._clock()
                at = now
                if target is not None and now > target:
                    # Woke late: account the token at its scheduled time, so the lateness is credited to the
                    # next waiter (up to max_tokens) instead of being lost and dragging the rate down.
                    at = max(target, self._last)
                delay = self._delay(at)
                if delay <= _EPS:
                    break
                target = at + delay
                await self._sleep(max(0.0, target - now))
        finally:
            self._leave(me)
        waited = max(0.0, self._clock() - start)
        self._take(at, waited)
        return waited

    def _take(self, now: float, waited: float) -> None:
        self._refill(now)
        self._tokens -= 1.0
        st = self.stats
        st.acquires += 1
        if waited > 0:
            st.waits += 1
            st.total_wait_s += waited
            st.max_wait_s = max(st.max_wait_s, waited)

    def _leave(self, me: asyncio.Future[None]) -> None:
        was_head = bool(self._waiters) and self._waiters[0] is me
        with contextlib.suppress(ValueError):
            self._waiters.remove(me)
        if not me.done():
            me.cancel()
        if was_head:
            # Hand the head position on; skip waiters whose loop is gone (a closed event loop).
            while self._waiters:
                nxt = self._waiters[0]
                if nxt.done() or nxt.get_loop().is_closed():
                    self._waiters.popleft()
                    continue
                nxt.set_result(None)
                break

    # -- adaptation --------------------------------------------------------------------------------------------

    def backoff(self, retry_after: float | None = None) -> None:
        """Report a 429: slow down, and when ``retry_after`` is given let nobody through before now + it."""
        now = self._clock()
        self._refill(now)
        self.stats.hits += 1
        if retry_after is not None and retry_after > 0:
            self._blocked_until = max(self._blocked_until, now + retry_after)
        if now - self._last_change < self.interval:
            return  # same burst of 429s as the last backoff: honour Retry-After but do not cut again
        self._rate = max(self.min_rpm / 60.0, self._rate * self.backoff_factor)
        self._tokens = min(self._tokens, 0.0)  # the next request waits a full (new) interval
        self._last_change = now
        self.stats.backoffs += 1

    def recover(self) -> None:
        """Report a success: creep back toward the configured rpm, at most once per token interval."""
        if self._rate >= self.rpm / 60.0:
            return
        now = self._clock()
        if now - self._last_change < self.interval:
            return
        self._refill(now)
        self._rate = min(self.rpm / 60.0, self._rate * self.recovery_factor)
        self._last_change = now
        self.stats.recoveries += 1

    def __repr__(self) -> str:
        return (
            f"RateLimiter(rpm={self.rpm:g}, current_rpm={self.current_rpm:.4g}, "
            f"max_tokens={self.max_tokens:g}, waiting={len(self._waiters)})"
        )
