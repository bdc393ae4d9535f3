"""Both limits of one endpoint around requests, fed back with the responses' statuses."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis as AsyncRedis

from app.jobs.limits import EndpointLimiter, endpoint_id
from app.pipeline import EndpointConfig


async def test_requests_take_a_slot_and_a_token_and_statuses_adapt_the_rate(
    aredis: AsyncRedis, prefix: str
) -> None:
    config = EndpointConfig(
        "openai", "m", base_url="http://127.0.0.1:9/v1", rate_limit=6000, max_concurrent=2
    )
    limiter = EndpointLimiter.for_endpoint(aredis, config, prefix=prefix)
    assert limiter.endpoint == "openai:m@http://127.0.0.1:9/v1"
    inside = peak = 0

    async def one() -> None:
        nonlocal inside, peak
        async with limiter.request() as permit:
            assert permit.lease is not None
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.02)
            inside -= 1
        await limiter.report(status=200)

    await asyncio.gather(*(one() for _ in range(8)))
    assert peak == 2
    assert limiter.rate is not None and limiter.slots is not None
    assert (await limiter.rate.peek()).acquires == 8

    await limiter.report(status=429, retry_after=0.2)
    state = await limiter.rate.peek()
    assert state.current_rpm == pytest.approx(3000)
    assert state.blocked_for_s > 0.1
    await limiter.report(status=500)  # neither a 429 nor a success: no change
    await limiter.report(status=None)  # no response at all (connection error)
    assert (await limiter.rate.peek()).hits == 1
    async with limiter.request() as permit:
        assert permit.waited_s >= 0.1  # the next request waited out the Retry-After
    await asyncio.sleep(0.02)
    await limiter.report(status=200)
    assert (await limiter.rate.peek()).current_rpm == pytest.approx(3300)
    await limiter.aclose()


async def test_an_endpoint_without_limits_lets_everything_through(aredis: AsyncRedis, prefix: str) -> None:
    limiter = EndpointLimiter.for_endpoint(aredis, EndpointConfig("vllm", "m"), prefix=prefix)
    assert endpoint_id(EndpointConfig("vllm", "m")) == "vllm:m@local"
    async with limiter.request() as permit:
        assert (permit.waited_s, permit.lease) == (0.0, None)
    await limiter.report(status=429, retry_after=5)  # nothing to adapt
    assert await aredis.keys(f"{prefix}*") == []
