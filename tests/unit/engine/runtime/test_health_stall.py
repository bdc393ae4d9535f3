"""``/health`` over a real engine whose step is held: 503 once work waited the stall window, first step or not."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.main import create_app
from app.engine import AsyncEngine, LLMEngine, SamplingParams
from app.serving.backends.native import NativeBackend
from app.settings import Settings
from tests.support.engine_runtime import random_prompts

STALL = 1.0  # wide enough that a loaded 2-core CI machine answers the first /health inside it
PROMPT = random_prompts(1, 5, 5, seed=3)[0]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


class HeldSteps:
    """Replaces ``engine.step``: every step waits until the test releases the gate."""

    def __init__(self, engine: LLMEngine) -> None:
        self.gate = threading.Event()
        self._step = engine.step

    def __call__(self) -> Any:
        self.gate.wait(30)
        return self._step()


@pytest.fixture
async def held(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, NativeBackend, HeldSteps]]:
    engine = make_engine()
    steps = HeldSteps(engine)
    monkeypatch.setattr(engine, "step", steps)
    backend = NativeBackend(engine=AsyncEngine(engine), health_stall_seconds=STALL)
    await backend.start()
    app = create_app(Settings(data_dir=tmp_path), backend=backend)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client, backend, steps
    finally:
        steps.gate.set()
        await backend.stop()


async def _until_unhealthy(client: httpx.AsyncClient) -> httpx.Response:
    deadline = time.monotonic() + 10 * STALL
    while True:
        response = await client.get("/health")
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(STALL / 5)


async def test_health_is_503_when_the_first_step_never_comes(
    held: tuple[httpx.AsyncClient, NativeBackend, HeldSteps],
) -> None:
    client, backend, steps = held
    engine = backend.engine
    assert engine is not None
    assert (await client.get("/health")).json() == {"status": "ok"}  # idle: nothing waits
    await asyncio.sleep(2 * STALL)  # idle longer than the window: must not count against the work to come
    stream = await engine.add_request(PROMPT, PARAMS)
    assert (await client.get("/health")).status_code == 200  # the work has only just arrived
    response = await _until_unhealthy(client)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_unhealthy" and error["type"] == "service_unavailable"
    assert "no step" in error["message"] and "since its work arrived" in error["message"]
    assert engine.last_step_time is None  # never stepped, and still caught
    steps.gate.set()  # the engine steps again: healthy while it finishes, and after
    outputs = [output async for output in stream]
    assert outputs[-1].finished
    assert (await client.get("/health")).status_code == 200


async def test_health_is_503_when_a_later_step_stalls_after_a_long_idle(
    held: tuple[httpx.AsyncClient, NativeBackend, HeldSteps],
) -> None:
    client, backend, steps = held
    engine = backend.engine
    assert engine is not None
    steps.gate.set()
    assert [o async for o in await engine.add_request(PROMPT, PARAMS)][-1].finished
    assert engine.last_step_time is not None
    steps.gate.clear()
    engine.last_step_time -= 3600  # the last step was an hour ago: new work is not stalled at once
    stream = await engine.add_request(PROMPT, PARAMS)
    assert (await client.get("/health")).status_code == 200
    response = await _until_unhealthy(client)
    assert response.status_code == 503 and "no step" in response.json()["error"]["message"]
    steps.gate.set()
    assert [o async for o in stream][-1].finished
    assert (await client.get("/health")).status_code == 200
