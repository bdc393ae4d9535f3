"""``AsyncEngine``: streaming, continuous batching of concurrent callers, abort on cancel, back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.engine import AsyncEngine, EngineDeadError, EngineQueueFullError, LLMEngine, SamplingParams
from app.engine.outputs import RequestOutput
from tests.support.engine_runtime import random_prompts

PROMPTS = random_prompts(16, 4, 30, seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


async def _idle(engine: LLMEngine, timeout: float = 5.0) -> bool:
    """Wait until the engine holds no request and no block."""
    bm = engine.block_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


async def _collect(aengine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in aengine.generate(prompt, params)]


async def test_streaming(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    [reference] = engine.generate([PROMPTS[0]], GREEDY)
    async with AsyncEngine(engine) as aengine:
        outs = await _collect(aengine, PROMPTS[0], GREEDY)
        assert len(outs) == 12 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 13))
        assert outs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outs[-1].outputs[0].text == reference.outputs[0].text
        assert aengine.is_running and aengine.errored is None
        assert aengine.last_step_time is not None and aengine.last_heartbeat is not None
    assert not aengine.is_running


async def test_concurrent_requests_are_batched(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    reference = engine.generate(PROMPTS, GREEDY)
    async with AsyncEngine(engine) as aengine:
        results = await asyncio.gather(*(_collect(aengine, p, GREEDY) for p in PROMPTS))
        steps = aengine.num_steps
    assert [r[-1].outputs[0].token_ids for r in results] == [o.outputs[0].token_ids for o in reference]
    # Sequentially this takes 16 x 12 steps; batched, about 12 (plus a few while requests trickle in).
    assert steps <= 2 * 12, steps
    assert engine.get_stats().request_success == {"length": 32}


async def test_abort_when_consumer_stops_or_is_cancelled(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    async with AsyncEngine(engine) as aengine:
        # 1. The consumer leaves the loop early (aclosing makes the generator's cleanup immediate).
        async with contextlib.aclosing(aengine.generate(PROMPTS[0], long, request_id="early")) as gen:
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 2:
                    break
        assert await _idle(engine)

        # 2. The consuming task is cancelled mid-stream.
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in aengine.generate(PROMPTS[1], long, request_id="cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 5)
        assert engine.has_unfinished_requests()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _idle(engine)

        # 3. An explicit abort from elsewhere ends the stream with finish_reason "abort".
        stream = await aengine.add_request(PROMPTS[2], long, request_id="explicit")
        first = await stream.__anext__()
        aengine.abort("explicit")
        rest = [o async for o in stream]
        assert not first.finished and rest[-1].finished
        assert rest[-1].outputs[0].finish_reason == "abort"
        assert await _idle(engine)
        assert aengine.num_unfinished_requests == 0
    assert engine.get_stats().request_success == {"abort": 3}


async def test_invalid_request_raises_and_others_continue(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    async with AsyncEngine(engine) as aengine:
        good = asyncio.create_task(_collect(aengine, PROMPTS[0], GREEDY))
        with pytest.raises(ValueError, match="empty"):
            await aengine.add_request("", GREEDY)
        with pytest.raises(ValueError, match="maximum context length"):
            async for _ in aengine.generate([5] * (engine.max_model_len + 1), GREEDY):
                pass
        outs = await good
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(
                aengine.add_request(PROMPTS[0], GREEDY, request_id="dup"),
                aengine.add_request(PROMPTS[0], GREEDY, request_id="dup"),
            )
        aengine.abort("dup")
        assert await _idle(engine)


async def test_queue_full(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_num_seqs=1, max_waiting=2)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with AsyncEngine(engine) as aengine:
        running = await aengine.add_request(PROMPTS[0], long)
        await running.__anext__()  # it is running now, not waiting
        waiting = [await aengine.add_request(p, long) for p in PROMPTS[1:3]]
        with pytest.raises(EngineQueueFullError, match="full"):
            await aengine.add_request(PROMPTS[3], long)
        assert aengine.get_stats().num_requests_waiting == 2
        for stream in [running, *waiting]:
            stream.abort()
        assert await _idle(engine)
        # Room again: accepted.
        outs = await _collect(aengine, PROMPTS[3], GREEDY)
        assert outs[-1].finished


async def test_engine_failure_is_reported(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    aengine = AsyncEngine(engine)
    await aengine.start()

    def broken() -> list[RequestOutput]:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken)
    with pytest.raises(EngineDeadError, match="device lost"):
        await _collect(aengine, PROMPTS[0], GREEDY)
    assert not aengine.is_running and isinstance(aengine.errored, RuntimeError)
    with pytest.raises(EngineDeadError):
        await aengine.add_request(PROMPTS[0], GREEDY)
    await aengine.shutdown()


async def test_event_loop_stays_responsive(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    async with AsyncEngine(engine) as aengine:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        await asyncio.gather(*(_collect(aengine, p, GREEDY) for p in PROMPTS[:4]))
        done.set()
        await tick_task
    assert ticks >= aengine.num_steps // 2  # the loop ran between (and during) steps


async def test_create_loads_off_the_event_loop(tiny: dict[str, tuple[Path, Any]]) -> None:
    folder, _ = tiny["gpt2"]
    aengine = await AsyncEngine.create(
        model=str(folder), kv_cache_memory_bytes=1 << 22, heartbeat_interval_s=0.05
    )
    try:
        assert aengine.is_running
        before = aengine.last_heartbeat
        await asyncio.sleep(0.2)
        assert aengine.last_heartbeat is not None and before is not None and aengine.last_heartbeat > before
        outs = await _collect(aengine, "the quick", SamplingParams(max_tokens=3, ignore_eos=True))
        assert outs[-1].finished and outs[-1].prompt == "the quick"
    finally:
        await aengine.shutdown()
