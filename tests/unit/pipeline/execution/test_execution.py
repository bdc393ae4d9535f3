"""Execution with a scripted fake LM: run(), batches, streams, retries, rate limits, timeouts, settings."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.pipeline import (
    ExecutionSettings,
    ExecutionState,
    LLMInference,
    Module,
    RateLimitError,
    Scheduler,
    TaskStatus,
    TransientError,
    run,
    trace,
)
from app.pipeline import functional as F
from tests.support.fakes import ScriptedLM


class FanOut(Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = LLMInference("fast", system_prompt="A")
        self.b = LLMInference("fast", system_prompt="B")
        self.c = LLMInference("smart")

    def forward(self, text):
        return self.c(f"compare {self.a(text)} with {self.b(text)}")


class Upper(Module):
    def forward(self, text: str) -> str:
        return text.upper()


class TwoOutputs(Module):
    def __init__(self) -> None:
        super().__init__()
        self.llm = LLMInference("fast")
        self.upper = Upper()

    def forward(self, text):
        return {"answer": self.llm(text), "shout": self.upper(text), "words": F.concat(text, "!", sep=" ")}


async def test_run_single_output_is_unwrapped() -> None:
    lm = ScriptedLM()
    out = await run(FanOut(), "hi", resources=lm)
    assert out == "[smart] compare [fast] hi with [fast] hi"
    assert sorted(c[2] or "" for c in lm.calls) == ["", "A", "B"]


async def test_several_outputs_keyed_like_forward_return() -> None:
    out = await run(TwoOutputs(), "hi", resources=ScriptedLM())
    assert out == {"answer": "[fast] hi", "shout": "HI", "words": "hi !"}


async def test_independent_branches_run_concurrently() -> None:
    lm = ScriptedLM(latency=0.2)
    start = time.perf_counter()
    await run(FanOut(), "x", resources=lm)
    elapsed = time.perf_counter() - start
    assert lm.peak_in_flight == 2
    assert elapsed < 0.55  # two levels of 0.2 s, not three calls in a row


async def test_bind_batch_returns_in_input_order_and_respects_max_concurrent() -> None:
    lm = ScriptedLM(latency=0.01)
    pipeline = FanOut().bind(resources=lm, max_concurrent=5)
    out = await pipeline([f"t{i}" for i in range(20)])
    assert [o.rsplit(" ", 1)[-1] for o in out] == [f"t{i}" for i in range(20)]
    assert lm.peak_in_flight <= 5
    assert len(lm.calls) == 60


async def test_plain_batch_raises_on_failure() -> None:
    def reply(alias, req):
        if "bad" in str(req.prompt):
            raise ValueError("boom")
        return "ok"

    pipeline = FanOut().bind(resources=ScriptedLM(reply))
    with pytest.raises(ValueError, match="boom"):
        await pipeline(["good", "bad", "good"])


async def test_stream_isolates_failures_and_reports_progress() -> None:
    def reply(alias, req):
        if "bad" in str(req.prompt):
            raise ValueError("boom")
        return "ok"

    progress: list[tuple[int, int]] = []
    results = []
    async with ExecutionSettings(resources=ScriptedLM(reply), streaming=True,
                                 on_progress=lambda d, t: progress.append((d, t))):
        async for result in FanOut()(["good", "bad", "good2"]):
            results.append(result)
    assert sorted(r.index for r in results) == [0, 1, 2]
    by_index = {r.index: r for r in results}
    assert by_index[1].ok is False and isinstance(by_index[1].error, ValueError)
    assert by_index[0].ok and by_index[0].output == "ok" and by_index[0].input == "good"
    assert progress[-1] == (3, 3)


async def test_stream_completion_order_and_preserve_order() -> None:
    def reply(alias, req):
        return "done"

    class Slow(Module):
        async def forward(self, delay):
            await asyncio.sleep(delay)
            return delay

    inputs = [0.15, 0.01, 0.08]
    async with ExecutionSettings(resources=ScriptedLM(reply), streaming=True):
        order = [r.index async for r in Slow()(inputs)]
        assert order == [1, 2, 0]
        ordered = [r.index async for r in Slow()(inputs, preserve_order=True)]
        assert ordered == [0, 1, 2]


async def test_breaking_out_of_a_stream_cancels_the_rest() -> None:
    lm = ScriptedLM(latency=0.3)
    async with ExecutionSettings(resources=lm, streaming=True, max_concurrent=4):
        async for _ in FanOut()([f"x{i}" for i in range(40)]):
            break
    calls_at_break = len(lm.calls)
    await asyncio.sleep(0.5)
    assert len(lm.calls) == calls_at_break  # nothing new was sent after the break
    assert lm.in_flight == 0  # in-flight requests were cancelled


async def test_transient_errors_retry_with_exponential_delay_then_fail() -> None:
    times: list[float] = []

    def reply(alias, req):
        times.append(time.perf_counter())
        raise TransientError("503")

    with pytest.raises(TransientError):
        await run(FanOut(), "x", resources=ScriptedLM(reply), max_task_retries=2, task_retry_delay=0.05)
    # both first-level calls: 1 try + 2 retries each; the dependent never runs
    assert len(times) == 6
    first = sorted(times)[::2][:3]
    assert first[1] - first[0] >= 0.045 and first[2] - first[1] >= 0.095


async def test_transient_error_then_success() -> None:
    attempts = {"n": 0}

    def reply(alias, req):
        attempts["n"] += 1
        if attempts["n"] <= 2:
            raise TransientError("flaky")
        return "fine"

    class One(Module):
        def __init__(self):
            super().__init__()
            self.llm = LLMInference("fast")

        def forward(self, x):
            return self.llm(x)

    assert await run(One(), "x", resources=ScriptedLM(reply), max_task_retries=3, task_retry_delay=0.01) == "fine"


async def test_non_transient_error_fails_without_retry_and_cancels_descendants() -> None:
    lm = ScriptedLM(lambda a, r: (_ for _ in ()).throw(KeyError("nope")))
    graph = trace(FanOut(), "x")
    state = ExecutionState(graph)
    scheduler = Scheduler(lm, max_task_retries=5, task_retry_delay=0.01)
    await scheduler.submit(state)
    assert len(lm.calls) == 2
    assert state.status["LLMInference_4"] is TaskStatus.CANCELLED
    assert isinstance(state.first_error(), KeyError)


async def test_rate_limit_requeues_until_success() -> None:
    hits = {"n": 0}

    def reply(alias, req):
        hits["n"] += 1
        if hits["n"] <= 3:
            raise RateLimitError(retry_after=0.01)
        return "ok"

    out = await run(FanOut(), "x", resources=ScriptedLM(reply))
    assert out == "ok"
    assert hits["n"] == 6


async def test_task_timeout_is_transient() -> None:
    lm = ScriptedLM(latency=0.5)
    start = time.perf_counter()
    with pytest.raises(TransientError, match="timed out"):
        await run(FanOut(), "x", resources=lm, task_timeout=0.05, max_task_retries=1, task_retry_delay=0.01)
    assert time.perf_counter() - start < 0.4
    assert len(lm.calls) == 4


async def test_execution_settings_nest_and_call_kwargs_win() -> None:
    lm = ScriptedLM(latency=0.02)
    with ExecutionSettings(resources=lm, max_concurrent=3):
        with ExecutionSettings(max_concurrent=1):
            await FanOut()(["a", "b"])
            assert lm.peak_in_flight == 1
        lm.peak_in_flight = 0
        await FanOut()(["a", "b", "c", "d"])
        assert lm.peak_in_flight == 3
        lm.peak_in_flight = 0
        await FanOut()(["a", "b", "c", "d"], max_concurrent=2)
        assert lm.peak_in_flight == 2


async def test_bind_overrides_execution_settings() -> None:
    outer, bound = ScriptedLM(), ScriptedLM()
    async with ExecutionSettings(resources=outer):
        await FanOut().bind(resources=bound)("x")
    assert len(bound.calls) == 3 and not outer.calls


def test_run_sync_outside_a_loop_and_refused_inside() -> None:
    pipeline = FanOut().bind(resources=ScriptedLM())
    assert pipeline.run_sync("s").endswith("with [fast] s")

    async def inside() -> None:
        with pytest.raises(RuntimeError, match="running event loop"):
            pipeline.run_sync("s")

    asyncio.run(inside())


async def test_error_values_short_circuit_downstream() -> None:
    class Divide(Module):
        def __init__(self):
            super().__init__()
            self.llm = LLMInference("fast")

        def forward(self, a, b):
            return self.llm(F.render("ratio {r}", {"r": F.div(a, b)}))

    lm = ScriptedLM()
    with pytest.raises(ZeroDivisionError):
        await run(Divide(), 1, 0, resources=lm)
    assert lm.calls == []  # the LLM node got an ERROR input and did not run


async def test_missing_resources_is_a_clear_error() -> None:
    class One(Module):
        def __init__(self):
            super().__init__()
            self.llm = LLMInference("fast")

        def forward(self, x):
            return self.llm(x)

    with pytest.raises(Exception, match="no resources were given"):
        await run(One(), "x")


async def test_tuple_outputs_stay_tuples() -> None:
    class Pair(Module):
        def __init__(self) -> None:
            super().__init__()
            self.llm = LLMInference("fast")

        def forward(self, text):
            return self.llm(text), F.upper(text)

    assert await run(Pair(), "hi", resources=ScriptedLM()) == ("[fast] hi", "HI")
