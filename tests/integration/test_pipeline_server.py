"""The pipeline framework against a real OpenAI-compatible fake server on 127.0.0.1, counting at the server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from app.pipeline import (
    EndpointConfig,
    ExecutionSettings,
    LLMInference,
    Module,
    ResourceConfig,
    ResourceManager,
    TransientError,
    run,
)
from app.testing.fake_llm_server import FakeLLMServer


class FanOut(Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = LLMInference("llm", system_prompt="first")
        self.second = LLMInference("llm", system_prompt="second")
        self.join = LLMInference("llm", system_prompt="join")

    def forward(self, text):
        return self.join(f"A={self.first(text)} B={self.second(text)}")


class DistinctFanOut(FanOut):
    """Each call has its own user text, so the server's per-prompt counts identify nodes."""

    def forward(self, text):
        return self.join(f"A={self.first(f'1:{text}')} B={self.second(f'2:{text}')}")


class One(Module):
    def __init__(self) -> None:
        super().__init__()
        self.llm = LLMInference("llm")

    def forward(self, text):
        return self.llm(text)


@pytest.fixture
def server() -> Iterator[FakeLLMServer]:
    with FakeLLMServer() as srv:
        yield srv


def resources(server: FakeLLMServer, **endpoint: object) -> ResourceConfig:
    return ResourceConfig({"llm": EndpointConfig("openai", "fake", base_url=server.base_url, api_key="sk-test",
                                                 **endpoint)})


async def test_pipeline_outputs_use_real_payloads(server: FakeLLMServer) -> None:
    out = await run(FanOut(), "hello", resources=resources(server))
    assert out == "echo: A=echo: hello B=echo: hello"
    assert "Value(" not in str(server.stats()["prompts"])


async def test_rate_limit_holds_at_the_server(server: FakeLLMServer) -> None:
    rpm = 1200.0  # 20 requests/s
    n = 60
    await One().bind(resources=resources(server, rate_limit=rpm), max_concurrent=32)([f"q{i}" for i in range(n)])
    stamps = sorted(server.stats()["timestamps"])
    assert len(stamps) == n
    measured = (len(stamps) - 1) / (stamps[-1] - stamps[0]) * 60.0
    assert abs(measured - rpm) / rpm <= 0.10, measured


async def test_429s_slow_every_caller_and_all_items_succeed(server: FakeLLMServer) -> None:
    server.configure(rpm=600, rpm_burst=5, latency=0.01)  # the server allows 10/s and answers 429 beyond
    manager = ResourceManager(resources(server, rate_limit=3000))  # we start far too fast
    items = [f"q{i}" for i in range(40)]
    async with ExecutionSettings(resources=manager, max_concurrent=16):
        out = await One()(items)
    assert out == [f"echo: q{i}" for i in range(40)]
    stats = server.stats()
    assert stats["by_status"].get("429", 0) > 0
    assert stats["by_status"]["200"] == 40
    limiter = manager.rate_limiters("llm")[0]
    assert limiter is not None and limiter.current_rpm < 3000  # the shared limiter backed off
    assert manager.metrics("llm").rate_limited == stats["by_status"]["429"]
    await manager.aclose()


async def test_transient_errors_are_retried_then_fail_cleanly(server: FakeLLMServer) -> None:
    with pytest.raises(TransientError):
        await run(One(), "x [[status:500]]", resources=resources(server), max_task_retries=2, task_retry_delay=0.01)
    assert server.stats()["prompts"]["x [[status:500]]"] == 3
    server.reset()
    server.configure(fail_next=2, fail_status=503)
    out = await run(One(), "ok", resources=resources(server), max_task_retries=2, task_retry_delay=0.01)
    assert out == "echo: ok"
    assert server.stats()["total"] == 3


async def test_timeouts_are_retried(server: FakeLLMServer) -> None:
    start = time.perf_counter()
    with pytest.raises(TransientError):
        await run(One(), "slow [[latency:2]]", resources=resources(server), task_timeout=0.2, max_task_retries=1,
                  task_retry_delay=0.01)
    assert time.perf_counter() - start < 1.5
    assert server.stats()["prompts"]["slow [[latency:2]]"] == 2


async def test_resumed_run_resends_no_completed_node(server: FakeLLMServer, tmp_path) -> None:
    from app.pipeline import CheckpointManager

    server.configure(latency=0.05)
    bad = "bad [[status:400]]"
    items = [f"doc{i}" for i in range(10)] + [bad] + [f"doc{i}" for i in range(10, 30)]
    cfg = resources(server)
    pipeline = DistinctFanOut().bind(resources=cfg, checkpoint_dir=tmp_path, execution_id="job-1", max_concurrent=4)
    with pytest.raises(Exception, match="400"):
        await pipeline(items)  # the bad item fails once the first items are done, and cancels the rest
    checkpoint = CheckpointManager(tmp_path).load("job-1")
    assert checkpoint is not None
    completed_prompts = {
        str(result.value.payload).removeprefix("echo: ") for result in checkpoint.completed_nodes.values()
        if str(result.value.payload).startswith("echo: ")
    }
    assert completed_prompts, "some nodes should have completed before the failure"
    server.reset()
    good = [item for item in items if item != bad]
    out = await DistinctFanOut().bind(resources=cfg, checkpoint_dir=tmp_path, execution_id="job-1")(good)
    assert out == [f"echo: A=echo: 1:{d} B=echo: 2:{d}" for d in good]
    resent = set(server.stats()["prompts"])
    assert resent, "the unfinished items must run in the second run"
    assert not (resent & completed_prompts), f"completed nodes were sent again: {resent & completed_prompts}"


async def test_breaking_out_of_a_stream_cancels_outstanding_requests(server: FakeLLMServer) -> None:
    server.configure(latency=0.3)
    async with ExecutionSettings(resources=resources(server), streaming=True, max_concurrent=8):
        async for result in One()([f"q{i}" for i in range(100)]):
            assert result.ok
            break
    await asyncio.sleep(0.1)
    stats = server.stats()
    assert stats["total"] <= 16  # the first wave and at most one more, not 100
    await asyncio.sleep(0.5)
    assert server.stats()["total"] == stats["total"]  # nothing is sent after the break


async def test_fan_out_wall_time_is_the_longest_branch(server: FakeLLMServer) -> None:
    server.configure(latency=0.25)
    start = time.perf_counter()
    await run(FanOut(), "x", resources=resources(server))
    elapsed = time.perf_counter() - start
    assert elapsed < 0.7  # two levels of 0.25 s; three sequential calls would be 0.75 s
    assert server.stats()["max_in_flight"] == 2


async def test_profile_writes_a_chrome_trace(server: FakeLLMServer, tmp_path) -> None:
    import json

    path = tmp_path / "trace.json"
    await FanOut().bind(resources=resources(server), profile=True, profile_path=path)(["a", "b"])
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"LLMInference", "F.render"} <= names
    stats = trace["otherData"]["statistics"]
    assert stats["completed"] >= 8


async def test_profile_shows_rate_limit_waits(server: FakeLLMServer, tmp_path) -> None:
    import json

    path = tmp_path / "trace.json"
    items = [f"q{i}" for i in range(8)]
    await One().bind(resources=resources(server, rate_limit=600), profile=True, profile_path=path)(items)
    trace = json.loads(path.read_text())
    waits = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "wait" in e.get("cat", "")]
    assert len(waits) == 8
    assert max(e["dur"] for e in waits) > 400_000  # the 8th request waited ~0.7 s for its token (µs)
    assert trace["otherData"]["statistics"]["wait_time_s"] > 1.0
