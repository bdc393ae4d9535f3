"""``AsyncEngine`` with structured outputs: grammars compile off the step loop (a slow compile does not stall
the other requests' tokens), compile errors reach the caller, and ``best_of > n`` streams only its result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from app.engine import AsyncEngine, LLMEngine, SamplingParams, StructuredOutputsParams
from tests.support.engine_runtime import random_prompts

pytest.importorskip("xgrammar")

PROMPTS = random_prompts(2, 6, 12, seed=41)
SLOW_COMPILE_S = 0.6


async def test_slow_compile_does_not_stall_other_requests(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    compiler = engine.guided.compiler
    real = compiler._compile

    def slow(spec: StructuredOutputsParams, xgr_compiler: Any) -> Any:
        time.sleep(SLOW_COMPILE_S)  # like xgrammar's compile, it holds no GIL while it waits
        return real(spec, xgr_compiler)

    compiler._compile = slow  # type: ignore[method-assign]
    free = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    spec = StructuredOutputsParams(choice=["lazy dog", "brown fox"])
    stamps: list[float] = []
    async with AsyncEngine(engine) as aengine:
        stream = await aengine.add_request(PROMPTS[0], free)

        async def consume() -> None:
            async for _ in stream:
                stamps.append(time.monotonic())

        consumer = asyncio.create_task(consume())
        while not stamps:  # the free request is decoding
            await asyncio.sleep(0.001)
        t0 = time.monotonic()
        outputs = [
            o
            async for o in aengine.generate(
                PROMPTS[1], SamplingParams(max_tokens=20, structured_outputs=spec)
            )
        ]
        t1 = time.monotonic()
        await consumer
    assert outputs[-1].outputs[0].text in ("lazy dog", "brown fox")
    assert t1 - t0 >= SLOW_COMPILE_S
    during = [t for t in stamps if t0 < t < t0 + SLOW_COMPILE_S]
    # Tiny-model steps take milliseconds: a stalled loop would deliver nothing while the grammar compiles.
    assert len(during) >= 10, (len(during), len(stamps))
    assert compiler.num_compiles == 1 and compiler.num_hits == 1  # compiled off the loop, found when added


async def test_compile_error_reaches_the_caller(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    async with AsyncEngine(engine) as aengine:
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
        with pytest.raises(ValueError, match=r"structured_outputs\.regex: invalid regular expression"):
            await aengine.add_request(PROMPTS[0], bad)
        assert aengine.num_unfinished_requests == 0 and not engine.has_unfinished_requests()


async def test_best_of_streams_only_the_result(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    params = SamplingParams(n=2, best_of=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)
    async with AsyncEngine(engine) as aengine:
        outputs = [o async for o in aengine.generate(PROMPTS[0], params)]
    assert len(outputs) == 1 and outputs[0].finished
    assert [c.index for c in outputs[0].outputs] == [0, 1]
    logprobs = [c.cumulative_logprob for c in outputs[0].outputs]
    assert logprobs == sorted(logprobs, reverse=True)  # type: ignore[type-var]
