"""ResourceManager against real fake servers: pacing, 429 backoff, concurrency caps, balancing, metrics, cost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.pipeline.resources import (
    ConfigurationError,
    EndpointConfig,
    LLMRequest,
    RateLimitError,
    ResourceConfig,
    ResourceManager,
    TransientError,
)
from app.testing import FakeLLMServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as srv:
        yield srv


def endpoint(srv: FakeLLMServer, **kw: object) -> EndpointConfig:
    return EndpointConfig("vllm", "test-model", base_url=srv.base_url, **kw)  # type: ignore[arg-type]


async def call_with_retries(manager: ResourceManager, alias: str, prompt: str, attempts: int = 20) -> str:
    """What the scheduler does on 429: retry (the manager's limiter provides the waiting)."""
    for _ in range(attempts):
        try:
            return (await manager.complete(alias, LLMRequest(prompt))).content
        except RateLimitError:
            continue
    raise AssertionError(f"{prompt!r} still rate limited after {attempts} attempts")


def measured_rpm(timestamps: list[float]) -> float:
    return (len(timestamps) - 1) / (max(timestamps) - min(timestamps)) * 60.0


async def test_rate_limit_holds_as_seen_by_the_server(server: FakeLLMServer) -> None:
    rpm = 1500.0  # 25 requests per second
    async with ResourceManager({"paced": endpoint(server, rate_limit=rpm)}) as manager:
        await asyncio.gather(*(manager.complete("paced", LLMRequest(f"q{i}")) for i in range(51)))
    stamps = server.stats()["timestamps"]
    assert len(stamps) == 51
    assert measured_rpm(stamps) == pytest.approx(rpm, rel=0.10)


async def test_429_with_retry_after_pauses_every_caller_then_all_succeed(server: FakeLLMServer) -> None:
    server.configure(fail_next=3, fail_status=429, retry_after=0.5)
    async with ResourceManager({"api": endpoint(server, rate_limit=6000)}) as manager:
        prompts = [f"item {i}" for i in range(10)]
        results = await asyncio.gather(*(call_with_retries(manager, "api", p) for p in prompts))
        limiter = manager.rate_limiters("api")[0]
        assert limiter is not None
        assert limiter.stats.hits == 3 and limiter.stats.backoffs >= 1
        metrics = manager.metrics("api")
    assert results == [f"echo: {p}" for p in prompts]
    assert metrics.successes == 10 and metrics.rate_limited == 3 and metrics.failures == 3
    stats = server.stats()
    assert stats["by_status"] == {"429": 3, "200": 10}
    # The three rejected prompts were sent again; nothing else was.
    assert sorted(stats["prompts"].values()) == [1] * 7 + [2] * 3
    # Retry-After 0.5 s: after the first 429 nobody reached the server for ~0.5 s.
    stamps = stats["timestamps"]
    gap = stamps[1] - stamps[0]
    assert gap >= 0.45


async def test_server_side_rpm_limit_is_found_and_all_requests_finish() -> None:
    # The server allows 20/s; the endpoint was configured for 40/s. The limiter halves on the first 429s.
    async with FakeLLMServer(rpm=1200) as srv:
        manager = ResourceManager({"api": endpoint(srv, rate_limit=2400)})
        prompts = [f"doc {i}" for i in range(30)]
        results = await asyncio.gather(*(call_with_retries(manager, "api", p) for p in prompts))
        assert results == [f"echo: {p}" for p in prompts]
        limiter = manager.rate_limiters("api")[0]
        assert limiter is not None and limiter.stats.backoffs >= 1
        assert limiter.current_rpm < 2400
        await manager.aclose()
        assert srv.stats()["by_status"]["200"] == 30


async def test_max_concurrent_is_respected_per_endpoint(server: FakeLLMServer) -> None:
    server.configure(latency=0.1)
    async with ResourceManager({"narrow": endpoint(server, max_concurrent=3)}) as manager:
        tasks = [asyncio.create_task(manager.complete("narrow", LLMRequest(f"c{i}"))) for i in range(12)]
        await asyncio.sleep(0.05)
        assert manager.active("narrow") == 3
        assert manager.waiting("narrow") == 9
        responses = await asyncio.gather(*tasks)
    assert server.stats()["max_in_flight"] == 3
    # Later requests queued for a slot, and the manager says so.
    assert max(r.queue_time_ms or 0 for r in responses) >= 250


async def test_round_robin_across_two_servers() -> None:
    async with FakeLLMServer() as a, FakeLLMServer() as b:
        config = ResourceConfig({"pool": [endpoint(a), endpoint(b)]}, load_balancing="round_robin")
        async with ResourceManager(config) as manager:
            for i in range(10):
                await manager.complete("pool", LLMRequest(f"r{i}"))
            per_endpoint = [m.requests for m in manager.endpoint_metrics("pool")]
        assert a.stats()["total"] == 5 and b.stats()["total"] == 5
        assert per_endpoint == [5, 5]


async def test_least_loaded_spreads_concurrent_requests() -> None:
    async with FakeLLMServer(latency=0.05) as a, FakeLLMServer(latency=0.05) as b:
        config = ResourceConfig({"pool": [endpoint(a), endpoint(b)]}, load_balancing="least_loaded")
        async with ResourceManager(config) as manager:
            await asyncio.gather(*(manager.complete("pool", LLMRequest(f"r{i}")) for i in range(20)))
        assert a.stats()["total"] == 10 and b.stats()["total"] == 10
        assert a.stats()["max_in_flight"] == 10


async def test_random_balancing_uses_every_endpoint() -> None:
    async with FakeLLMServer() as a, FakeLLMServer() as b:
        config = ResourceConfig({"pool": [endpoint(a), endpoint(b)]}, load_balancing="random")
        async with ResourceManager(config, seed=7) as manager:
            for i in range(20):
                await manager.complete("pool", LLMRequest(f"r{i}"))
        assert a.stats()["total"] + b.stats()["total"] == 20
        assert a.stats()["total"] > 0 and b.stats()["total"] > 0


async def test_metrics_and_cost(server: FakeLLMServer) -> None:
    cheap = endpoint(server, input_cost_per_1m=1.0, output_cost_per_1m=2.0)
    pricey = EndpointConfig("vllm", "big", base_url=server.base_url, input_cost_per_1m=10.0, output_cost_per_1m=30.0)
    async with ResourceManager({"cheap": cheap, "pricey": pricey}) as manager:
        for _ in range(5):
            resp = await manager.complete("cheap", LLMRequest("a b c"))  # 3 tokens in, "echo: a b c" = 4 out
        assert resp.queue_time_ms is not None and resp.queue_time_ms >= 0
        await manager.complete("pricey", LLMRequest("one two"))  # 2 in, 3 out
        with pytest.raises(TransientError):
            await manager.complete("cheap", LLMRequest("x [[status:500]]"))
        with pytest.raises(RateLimitError) as info:
            await manager.complete("cheap", LLMRequest("x [[status:429]]"))
        assert info.value.alias == "cheap"

        m = manager.metrics("cheap")
        assert (m.requests, m.successes, m.failures, m.rate_limited) == (7, 5, 2, 1)
        assert (m.input_tokens, m.output_tokens) == (15, 20)
        assert m.success_rate == pytest.approx(5 / 7)
        assert m.min_latency_ms is not None and m.max_latency_ms is not None and m.avg_latency_ms is not None
        assert 0 < m.min_latency_ms <= m.avg_latency_ms <= m.max_latency_ms
        d = m.to_dict()
        assert d["requests"] == 7 and d["success_rate"] == pytest.approx(5 / 7)
        assert set(manager.metrics()) == {"cheap", "pricey"}

        cheap_cost = (15 * 1.0 + 20 * 2.0) / 1e6
        pricey_cost = (2 * 10.0 + 3 * 30.0) / 1e6
        assert manager.estimate_cost("cheap") == pytest.approx(cheap_cost)
        assert manager.estimate_cost(cheap) == pytest.approx(cheap_cost)
        assert manager.estimate_cost(pricey) == pytest.approx(pricey_cost)
        assert manager.estimate_cost() == pytest.approx(cheap_cost + pricey_cost)


async def test_unknown_alias_lists_the_configured_ones(server: FakeLLMServer) -> None:
    manager = ResourceManager({"fast": endpoint(server), "judge": endpoint(server)})
    assert manager.has_alias("fast") and not manager.has_alias("slow")
    assert manager.aliases() == ["fast", "judge"]
    assert manager.max_retries("fast") == 3
    assert manager.endpoints("judge")[0].model == "test-model"
    with pytest.raises(ConfigurationError, match=r"'slow'.*'fast', 'judge'"):
        await manager.complete("slow", LLMRequest("x"))
    with pytest.raises(ConfigurationError):
        manager.estimate_cost("slow")


def test_manager_works_from_several_event_loops() -> None:
    with FakeLLMServer() as srv:
        manager = ResourceManager({"api": endpoint(srv, max_concurrent=2, rate_limit=6000)})

        async def batch() -> list[str]:
            rs = await asyncio.gather(*(manager.complete("api", LLMRequest(f"x{i}")) for i in range(6)))
            return [r.content for r in rs]

        assert asyncio.run(batch()) == [f"echo: x{i}" for i in range(6)]
        assert asyncio.run(batch()) == [f"echo: x{i}" for i in range(6)]
        asyncio.run(manager.aclose())
        assert manager.metrics("api").successes == 12
        assert srv.stats()["max_in_flight"] <= 2


async def test_manager_accepts_plain_dicts(server: FakeLLMServer) -> None:
    manager = ResourceManager({"endpoints": {"x": {"provider": "vllm", "model": "m", "base_url": server.base_url}}})
    assert (await manager.complete("x", LLMRequest("hi"))).content == "echo: hi"
    await manager.aclose()
    assert ResourceManager().aliases() == []
