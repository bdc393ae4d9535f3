"""Global max concurrency on the real Redis: never above the max, dead holders' slots come back, releases wake."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits import ConcurrencySlots, SlotTimeoutError
from tests.integration.jobs.limits.conftest import result_of, start_worker


def test_slots_never_exceed_the_max_across_processes(prefix: str) -> None:
    start_at = time.time() + 2.0
    args = {
        "prefix": prefix,
        "endpoint": "ep",
        "max_slots": 4,
        "start_at": start_at,
        "duration": 1.5,
        "concurrency": 10,
        "counter": f"{prefix}:inside",
    }
    procs = [start_worker("slots", args) for _ in range(2)]
    results = [result_of(p, timeout=30) for p in procs]
    # 20 coroutines in two processes compete for 4 slots: the max is reached and never passed
    assert max(r["peak"] for r in results) == 4, results
    assert all(r["uses"] > 20 for r in results), results


async def test_a_dead_holders_slot_expires(aredis: AsyncRedis, prefix: str) -> None:
    holder = start_worker("hold", {"prefix": prefix, "endpoint": "ep", "max_slots": 1, "lease_ttl": 0.6})
    try:
        line = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 20)  # type: ignore[union-attr]
        assert line.strip() == "held"
        slots = ConcurrencySlots(aredis, "ep", 1, prefix=prefix, lease_ttl_s=0.6, poll_interval_s=0.05)
        # while the holder lives it renews its lease: nobody else gets the slot
        with pytest.raises(SlotTimeoutError, match="max_concurrent"):
            await slots.acquire(timeout=1.0)
        holder.kill()  # SIGKILL: no release, no goodbye
        holder.wait()
        start = time.monotonic()
        lease = await slots.acquire(timeout=5)
        assert time.monotonic() - start <= 0.6 + 0.3  # within the lease TTL of the death
        assert await slots.held() == 1
        await slots.release(lease)
        await slots.aclose()
    finally:
        holder.kill()
        holder.communicate()


async def test_a_release_wakes_a_waiter_at_once(aredis: AsyncRedis, prefix: str) -> None:
    # the waiter would only look again after 5 s on its own; the release's message wakes it
    slots = ConcurrencySlots(aredis, "ep", 1, prefix=prefix, poll_interval_s=5.0)
    other = ConcurrencySlots(aredis, "ep", 1, prefix=prefix, poll_interval_s=5.0)
    first = await slots.acquire()
    waiter = asyncio.create_task(other.acquire(timeout=4))
    await asyncio.sleep(0.2)
    released_at = time.monotonic()
    await slots.release(first)
    lease = await waiter
    assert time.monotonic() - released_at < 0.5
    assert lease.waited_s >= 0.15
    await other.release(lease)
    await slots.aclose()
    await other.aclose()


async def test_waiters_in_one_process_take_turns(aredis: AsyncRedis, prefix: str) -> None:
    slots = ConcurrencySlots(aredis, "ep", 2, prefix=prefix, poll_interval_s=0.05)
    inside = peak = 0

    async def one() -> None:
        nonlocal inside, peak
        async with slots.slot():
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(one() for _ in range(30)))
    assert peak == 2
    assert await slots.held() == 0
    await slots.aclose()


async def test_renewal_keeps_a_long_holder_and_reports_a_lost_lease(aredis: AsyncRedis, prefix: str) -> None:
    slots = ConcurrencySlots(aredis, "ep", 1, prefix=prefix, lease_ttl_s=0.3, poll_interval_s=0.05)
    async with slots.slot() as lease:
        await asyncio.sleep(0.8)  # well past the TTL: the background renewal kept it
        assert await slots.renew(lease)
        assert not lease.lost
    assert await slots.held() == 0

    stalled = await slots.acquire()  # taken without the context manager: nobody renews it
    await asyncio.sleep(0.4)
    assert not await slots.renew(stalled)
    assert stalled.lost
    await slots.aclose()


async def test_the_key_disappears_when_no_lease_is_left(aredis: AsyncRedis, prefix: str) -> None:
    slots = ConcurrencySlots(aredis, "ep", 3, prefix=prefix, lease_ttl_s=0.2)
    await slots.acquire()
    assert await aredis.exists(slots.keys.slots)
    await asyncio.sleep(0.35)
    assert not await aredis.exists(slots.keys.slots)  # Redis forgets a dead endpoint's slots by itself
