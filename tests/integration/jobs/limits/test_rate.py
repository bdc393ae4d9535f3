"""The global requests-per-minute limit on the real Redis: shared by processes, adaptive on 429, atomic."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits import GlobalRateLimiter, RateConfig
from tests.integration.jobs.limits.conftest import result_of, start_worker


def _max_in_window(times: list[float], width: float) -> int:
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_two_worker_processes_share_one_limit(prefix: str) -> None:
    rpm, duration = 1200.0, 3.0  # 20 requests/s between them, whatever each one asks for
    start_at = time.time() + 6.0  # both processes are up and waiting by then, even on a loaded machine
    args = {"prefix": prefix, "endpoint": "ep", "rpm": rpm, "start_at": start_at, "duration": duration}
    procs = [start_worker("rate", {**args, "concurrency": 6}) for _ in range(2)]
    grants = [result_of(p, timeout=30) for p in procs]

    every = [t for g in grants for t in g]
    ideal = rpm / 60 * duration
    # the bucket starts with one token; beyond that the two workers together stay within 10% of the limit
    assert len(every) <= 1.1 * ideal + 1, (len(every), ideal)
    assert len(every) >= 0.9 * ideal, (len(every), ideal)
    assert _max_in_window(every, 1.0) <= 1.1 * rpm / 60 + 1
    # both workers were served (a limit shared, not one worker starving the other)
    assert all(len(g) >= 0.25 * ideal for g in grants), [len(g) for g in grants]
    print(f"grants per worker {[len(g) for g in grants]}, ideal {ideal:g}")


async def test_a_429_slows_every_instance_and_honours_retry_after(aredis: AsyncRedis, prefix: str) -> None:
    config = RateConfig(rpm=1200)  # a token every 50 ms
    worker_a = GlobalRateLimiter(aredis, "ep", config, prefix=prefix)
    worker_b = GlobalRateLimiter(aredis, "ep", config, prefix=prefix)
    assert await worker_b.acquire() == 0.0  # a fresh limit has one token

    assert await worker_a.backoff(retry_after=0.6) == pytest.approx(600.0)
    state = await worker_b.peek()
    assert state.current_rpm == pytest.approx(600.0)
    assert 0.4 < state.blocked_for_s <= 0.6

    start = time.monotonic()
    await worker_b.acquire()  # the other worker waits out the Retry-After
    assert time.monotonic() - start >= 0.55
    start = time.monotonic()
    await worker_b.acquire()  # and then runs at the lowered rate: 100 ms apart instead of 50
    assert 0.08 <= time.monotonic() - start <= 0.3


async def test_a_429_cancels_reservations_of_sleeping_callers(aredis: AsyncRedis, prefix: str) -> None:
    worker_a = GlobalRateLimiter(aredis, "ep", RateConfig(rpm=300), prefix=prefix)  # a token every 200 ms
    worker_b = GlobalRateLimiter(aredis, "ep", RateConfig(rpm=300), prefix=prefix)
    await worker_b.acquire()
    start = time.monotonic()
    sleeping = asyncio.create_task(worker_b.acquire())  # its token is reserved for +200 ms
    await asyncio.sleep(0.05)
    await worker_a.backoff(retry_after=0.8)
    await sleeping
    # it did not go at +200 ms: it re-asked after the 429 and waited for the Retry-After
    assert time.monotonic() - start >= 0.8
    assert worker_b.stats.cancelled_reservations == 1


async def test_a_burst_of_429s_lowers_the_rate_once(aredis: AsyncRedis, prefix: str) -> None:
    limiter = GlobalRateLimiter(aredis, "ep", RateConfig(rpm=600, min_rpm=10), prefix=prefix)
    for _ in range(10):  # ten requests in flight all come back 429 within one token interval
        await limiter.backoff()
    state = await limiter.peek()
    assert (state.hits, state.backoffs) == (10, 1)
    assert state.current_rpm == pytest.approx(300)


async def test_the_rate_never_drops_below_min_rpm(aredis: AsyncRedis, prefix: str) -> None:
    limiter = GlobalRateLimiter(aredis, "ep", RateConfig(rpm=60_000, min_rpm=20_000), prefix=prefix)
    for _ in range(4):
        await limiter.backoff()
        await asyncio.sleep(0.004)  # past one token interval, so each counts
    assert (await limiter.peek()).current_rpm == pytest.approx(20_000)


async def test_successes_recover_the_rate_gradually(aredis: AsyncRedis, prefix: str) -> None:
    config = RateConfig(rpm=6000, recovery_factor=1.1)  # a token every 10 ms at full rate
    worker_a = GlobalRateLimiter(aredis, "ep", config, prefix=prefix)
    worker_b = GlobalRateLimiter(aredis, "ep", config, prefix=prefix)
    assert await worker_a.backoff() == pytest.approx(3000)
    # a burst of successes right after the cut changes nothing (at most one step per token interval)
    for _ in range(5):
        assert await worker_b.recover() == pytest.approx(3000)
    steps = []
    while len(steps) < 20 and (not steps or steps[-1] < 6000):
        await asyncio.sleep(0.025)
        steps.append(await worker_b.recover())
    # each step is x1.1 (seen by both workers), capped at the configured rpm
    assert steps[0] == pytest.approx(3300, rel=1e-6)
    assert steps[1] == pytest.approx(3630, rel=1e-6)
    assert steps[-1] == pytest.approx(6000)
    assert len(steps) == 8  # 3000 * 1.1**7 < 6000 <= 3000 * 1.1**8
    state = await worker_a.peek()
    assert (state.current_rpm, state.recoveries) == (pytest.approx(6000), 8)


async def test_concurrent_acquires_are_atomic(prefix: str) -> None:
    """200 callers on 200 connections at once: each gets its own token, none is handed out twice."""
    rpm, callers = 12_000.0, 200  # a token every 5 ms
    conns = [AsyncRedis.from_url("redis://127.0.0.1:6379/0") for _ in range(8)]
    limiters = [
        GlobalRateLimiter(conns[i % 8], "ep", RateConfig(rpm=rpm), prefix=prefix) for i in range(callers)
    ]
    try:
        start = time.monotonic()
        grants = []

        async def one(limiter: GlobalRateLimiter) -> None:
            await limiter.acquire()
            grants.append(time.monotonic())

        await asyncio.gather(*(one(limiter) for limiter in limiters))
        state = await limiters[0].peek()
    finally:
        for conn in conns:
            await conn.aclose()
    assert state.acquires == callers  # no lost update
    interval = 60 / rpm
    makespan = max(grants) - start
    assert makespan >= (callers - 1) * interval * 0.95  # no token handed out twice
    # liveness, not speed: waiters must not starve, but a loaded 2-core CI box wakes them late
    assert makespan <= (callers - 1) * interval * 3 + 1.0
    # no burst beyond the rate: any 0.5 s holds at most its tokens, plus 0.1 s of wake-up jitter on a loaded box
    assert _max_in_window(grants, 0.5) <= (0.5 + 0.1) / interval + 1


async def test_state_expires_when_idle(aredis: AsyncRedis, prefix: str) -> None:
    limiter = GlobalRateLimiter(aredis, "ep", RateConfig(rpm=600, idle_ttl_s=30), prefix=prefix)
    await limiter.acquire()
    ttl_ms = await aredis.pttl(limiter.keys.rate)
    assert 25_000 < ttl_ms <= 30_000  # nothing outlives its use by more than the idle TTL
