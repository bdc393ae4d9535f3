"""Max concurrency for one endpoint, shared by every worker: leased slots in Redis.

A slot is a member of a sorted set whose score is its expiry time. The holder renews it while it works (the
context managers do that in the background, every third of the lease TTL); a worker that dies stops renewing, and
its slot is freed by the next acquire after the TTL. Releasing publishes on a channel, so a waiting worker wakes at
once; without a message it still looks again when the first lease could expire, or every ``poll_interval_s``.

Inside one process only the first waiter talks to Redis (an ``asyncio.Lock`` / ``threading.Lock`` is a FIFO
queue), so a hundred waiting coroutines cost one round trip per freed slot, not a hundred.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits.scripts import SLOT_SCRIPT, LimitKeys

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 30.0
DEFAULT_POLL_INTERVAL_S = 0.5
_MIN_WAIT_S = 0.001


class SlotTimeoutError(TimeoutError):
    """No slot became free in time."""


@dataclass(slots=True)
class SlotLease:
    """One held slot. ``lost`` turns true when a renewal finds it expired (the holder stalled past the TTL)."""

    id: str
    endpoint: str
    acquired_at: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0  # how long acquire waited for it
    lost: bool = False


def _lease_id() -> str:
    # host and pid make a leaked slot traceable to the worker that took it
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _ints(reply: list[Any]) -> tuple[int, int]:
    return int(reply[0]), int(reply[1])


def _check(max_slots: int, lease_ttl_s: float, poll_interval_s: float) -> None:
    if max_slots < 1:
        raise ValueError(f"max_slots must be >= 1, got {max_slots}")
    if lease_ttl_s < 0.05:
        raise ValueError(f"lease_ttl_s must be >= 0.05 s (renewals run every third of it), got {lease_ttl_s}")
    if poll_interval_s <= 0:
        raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")


class _SlotsBase:
    def __init__(
        self, endpoint: str, max_slots: int, prefix: str, lease_ttl_s: float, poll_interval_s: float
    ) -> None:
        _check(max_slots, lease_ttl_s, poll_interval_s)
        self.endpoint = endpoint
        self.max_slots = max_slots
        self.lease_ttl_s = lease_ttl_s
        self.poll_interval_s = poll_interval_s
        self.keys = LimitKeys(prefix, endpoint)
        self.waits = 0
        self.total_wait_s = 0.0

    def _argv(self, op: str, lease: str = "") -> list[Any]:
        return [op, self.max_slots, int(self.lease_ttl_s * 1000), lease, self.keys.released]

    def _pause(self, until_expiry_ms: int, deadline: float | None) -> float:
        wait = min(self.poll_interval_s, max(_MIN_WAIT_S, until_expiry_ms / 1000))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SlotTimeoutError(
                    f"no concurrency slot for endpoint {self.endpoint!r} became free in time (all {self.max_slots} "
                    "are held); raise the endpoint's max_concurrent or the timeout"
                )
            wait = min(wait, left)
        return wait


class ConcurrencySlots(_SlotsBase):
    """Async slots on ``redis.asyncio``: ``async with slots.slot(): ...`` holds one for the block."""

    def __init__(
        self,
        redis: AsyncRedis,
        endpoint: str,
        max_slots: int,
        *,
        prefix: str = "inf",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        super().__init__(endpoint, max_slots, prefix, lease_ttl_s, poll_interval_s)
        self.redis = redis
        self._script = redis.register_script(SLOT_SCRIPT)
        self._head = asyncio.Lock()
        self._pubsub: Any = None

    async def _call(self, op: str, lease: str = "") -> tuple[int, int]:
        return _ints(list(await self._script(keys=[self.keys.slots], args=self._argv(op, lease))))

    async def _try(self, lease: str) -> tuple[bool, int]:
        ok, value = await self._call("acquire", lease)
        return bool(ok), value

    async def acquire(self, timeout: float | None = None) -> SlotLease:
        """Take a slot, waiting until one is free (``SlotTimeoutError`` after ``timeout`` seconds)."""
        lease = _lease_id()
        if not self._head.locked():
            ok, _ = await self._try(lease)
            if ok:
                return SlotLease(lease, self.endpoint)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        async with self._head:
            if self._pubsub is None:
                self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(self.keys.released)
            while True:
                ok, until_expiry_ms = await self._try(lease)
                if ok:
                    break
                await self._pubsub.get_message(timeout=self._pause(until_expiry_ms, deadline))
        waited = time.monotonic() - start
        self.waits += 1
        self.total_wait_s += waited
        return SlotLease(lease, self.endpoint, waited_s=waited)

    async def renew(self, lease: SlotLease) -> bool:
        """Push the lease's expiry a TTL ahead; False (and ``lease.lost``) when it had already expired."""
        ok, _ = await self._call("renew", lease.id)
        if not ok:
            lease.lost = True
        return bool(ok)

    async def release(self, lease: SlotLease) -> None:
        await self._call("release", lease.id)

    async def held(self) -> int:
        """Slots held right now, across all workers (expired ones dropped)."""
        count, _ = await self._call("count")
        return count

    @contextlib.asynccontextmanager
    async def slot(self, timeout: float | None = None) -> AsyncIterator[SlotLease]:
        lease = await self.acquire(timeout)
        keeper = asyncio.create_task(self._keep(lease))
        try:
            yield lease
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await self.release(lease)

    async def _keep(self, lease: SlotLease) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            if not await self.renew(lease):
                log.warning("slot lease %s of endpoint %r expired before renewal", lease.id, self.endpoint)
                return

    async def aclose(self) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()
            self._pubsub = None

    async def reset(self) -> None:
        await self.redis.delete(self.keys.slots)
