"""RateLimiter on a fake clock: pacing, FIFO, backoff, Retry-After, recovery, min_rpm; plus one real-time check."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.pipeline.resources import RateLimiter

pytestmark = pytest.mark.timeout(15)


class FakeClock:
    """A clock that only moves when a limiter sleeps on it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(clock: FakeClock, rpm: float = 60.0, **kw: float) -> RateLimiter:
    return RateLimiter(rpm, clock=clock, sleep=clock.sleep, **kw)


async def test_no_initial_burst_and_steady_spacing() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60)  # one per second
    waits = [await lim.acquire() for _ in range(5)]
    assert waits == pytest.approx([0, 1, 1, 1, 1])
    assert clock.now == pytest.approx(1004.0)
    assert lim.stats.acquires == 5 and lim.stats.waits == 4
    assert lim.stats.total_wait_s == pytest.approx(4.0)


async def test_waiters_are_served_in_arrival_order_without_polling() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=120)  # every 0.5 s
    order: list[tuple[int, float]] = []

    async def one(i: int) -> None:
        await lim.acquire()
        order.append((i, clock.now))

    await asyncio.gather(*(one(i) for i in range(6)))
    assert [i for i, _ in order] == list(range(6))
    assert [t - 1000.0 for _, t in order] == pytest.approx([0, 0.5, 1.0, 1.5, 2.0, 2.5])
    # Only the head of the queue sleeps, once per token: no busy loop.
    assert len(clock.sleeps) == 5


async def test_late_wakeups_do_not_slow_the_rate() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60)

    async def oversleep(seconds: float) -> None:  # a busy event loop wakes the head 0.3 s late every time
        clock.now += seconds + 0.3
        await asyncio.sleep(0)

    lim._sleep = oversleep
    await asyncio.gather(*(lim.acquire() for _ in range(11)))
    # 10 intervals of 1 s plus a single 0.3 s of lateness, not 10 x 1.3 s.
    assert clock.now - 1000.0 == pytest.approx(10.3)


async def test_idle_bucket_holds_at_most_max_tokens() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60, max_tokens=3)
    await lim.acquire()
    clock.advance(100)  # long idle: the bucket fills to 3, not 100
    waits = [await lim.acquire() for _ in range(5)]
    assert waits == pytest.approx([0, 0, 0, 1, 1])


async def test_backoff_halves_rate_and_respects_min_rpm() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60, min_rpm=10)
    lim.backoff()
    assert lim.current_rpm == pytest.approx(30)
    clock.advance(lim.interval)
    lim.backoff()
    assert lim.current_rpm == pytest.approx(15)
    clock.advance(lim.interval)
    lim.backoff()
    assert lim.current_rpm == pytest.approx(10)  # floored
    clock.advance(lim.interval)
    lim.backoff()
    assert lim.current_rpm == pytest.approx(10)
    assert lim.stats.hits == 4


async def test_a_burst_of_429s_counts_as_one_backoff() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=600)
    for _ in range(20):  # twenty in-flight requests all answered 429 at once
        lim.backoff()
    assert lim.current_rpm == pytest.approx(300)
    assert lim.stats.hits == 20 and lim.stats.backoffs == 1


async def test_backoff_slows_the_next_acquire() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60)
    await lim.acquire()
    lim.backoff()  # 30 rpm: 2 s per token, bucket emptied
    assert await lim.acquire() == pytest.approx(2.0)


async def test_retry_after_blocks_everybody_until_it_passes() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=6000)
    await lim.acquire()
    lim.backoff(retry_after=5.0)
    start = clock.now
    times: list[float] = []

    async def one() -> None:
        await lim.acquire()
        times.append(clock.now - start)

    await asyncio.gather(*(one() for _ in range(3)))
    assert times[0] == pytest.approx(5.0)
    assert all(t >= 5.0 for t in times)
    assert times == sorted(times)
    # After the block the pace is the backed-off rate (3000 rpm → 0.02 s apart).
    assert times[2] - times[1] == pytest.approx(0.02)


async def test_later_shorter_retry_after_does_not_shorten_the_block() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=6000)
    lim.backoff(retry_after=3.0)
    lim.backoff(retry_after=1.0)
    assert lim.blocked_until == pytest.approx(clock.now + 3.0)


async def test_recover_climbs_back_at_most_once_per_interval() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60, recovery_factor=1.5)
    lim.backoff()
    assert lim.current_rpm == pytest.approx(30)
    for _ in range(50):  # a burst of successes right after the backoff changes nothing
        lim.recover()
    assert lim.current_rpm == pytest.approx(30)
    clock.advance(lim.interval)
    lim.recover()
    lim.recover()
    assert lim.current_rpm == pytest.approx(45)
    clock.advance(lim.interval)
    lim.recover()
    assert lim.current_rpm == pytest.approx(60)  # capped at the configured rpm
    clock.advance(10)
    lim.recover()
    assert lim.current_rpm == pytest.approx(60)
    assert lim.stats.recoveries == 2


async def test_cancelled_waiter_does_not_block_the_queue() -> None:
    clock = FakeClock()
    lim = make(clock, rpm=60)
    await lim.acquire()
    blocked = asyncio.Event()

    async def never(_: float) -> None:  # the head sleeps until cancelled
        blocked.set()
        await asyncio.Event().wait()

    lim._sleep = never
    head = asyncio.create_task(lim.acquire())
    await blocked.wait()
    second = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0)
    assert lim.waiting == 2
    lim._sleep = clock.sleep
    head.cancel()
    assert await second == pytest.approx(1.0)
    assert lim.waiting == 0


def test_invalid_arguments_explain_themselves() -> None:
    with pytest.raises(ValueError, match="rpm must be > 0"):
        RateLimiter(0)
    with pytest.raises(ValueError, match="backoff_factor"):
        RateLimiter(60, backoff_factor=1.5)
    with pytest.raises(ValueError, match="recovery_factor"):
        RateLimiter(60, recovery_factor=1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        RateLimiter(60, max_tokens=0.5)


async def test_real_clock_rate_is_within_ten_percent() -> None:
    rpm = 3000.0  # 50 per second
    lim = RateLimiter(rpm)
    times: list[float] = []

    async def one() -> None:
        await lim.acquire()
        times.append(time.monotonic())

    await asyncio.gather(*(one() for _ in range(61)))
    measured = (len(times) - 1) / (max(times) - min(times)) * 60.0
    assert measured == pytest.approx(rpm, rel=0.10)
