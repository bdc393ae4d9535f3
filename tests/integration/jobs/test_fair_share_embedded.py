"""The embedded mode shares its node tasks in flight by the same policy as the workers' dispatch windows: a small
job of another tenant goes ahead of a big job's queue, a more urgent job goes first, and a less urgent one waits.
On PostgreSQL with a scripted LLM (50 ms a call); proven by counts, not by wall-clock bounds."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import Engine

from app.jobs.runtime import JobsRuntime
from app.jobs.service import describe_job
from app.jobs.submission import JobRequest, submit_job
from app.settings import Settings
from tests.support.fakes import ScriptedLM

BIG = 400  # 8 items in flight at 50 ms a call: about 2.5 s


def _runtime(engine: Engine, lm: ScriptedLM) -> JobsRuntime:
    url = engine.url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, jobs_poll_interval=0.05, dispatch_window=8)
    return JobsRuntime(settings, resources=lm)


async def _submit(runtime: JobsRuntime, prefix: str, n: int, owner: str, priority: int = 0) -> str:
    inputs = [{"custom_id": f"{prefix}{i}", "input": f"review {i}: fine"} for i in range(n)]

    def work() -> str:
        with runtime.session() as session:
            request = JobRequest("sentiment", inputs=inputs, priority=priority)
            return submit_job(session, request, owner=owner)[0].id

    job_id = await asyncio.to_thread(work)
    runtime.wake()
    return job_id


def _view(runtime: JobsRuntime, job_id: str) -> dict[str, Any]:
    with runtime.session() as session:
        return describe_job(session, job_id)


async def _until(runtime: JobsRuntime, job_id: str, done: int | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the job has ``done`` completed items (None: until it is terminal)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        view = _view(runtime, job_id)
        if (done is None and view["status"] in {"completed", "failed", "cancelled"}) or (
            done is not None and view["counts"]["completed"] >= done
        ):
            return view
        assert asyncio.get_running_loop().time() < deadline, view
        await asyncio.sleep(0.02)


async def _big_job_under_way(engine: Engine) -> tuple[JobsRuntime, str]:
    """A started runtime, and tenant acme's BIG-item job once 20 of its items are done."""
    runtime = _runtime(engine, ScriptedLM(latency=0.05))
    await runtime.ensure_started()
    big = await _submit(runtime, "a", BIG, owner="acme")
    await _until(runtime, big, done=20)
    return runtime, big


async def test_a_small_job_of_another_tenant_goes_ahead_of_a_big_jobs_items(committed: Engine) -> None:
    runtime, big = await _big_job_under_way(committed)
    try:
        small = await _submit(runtime, "b", 10, owner="beta")
        assert (await _until(runtime, small))["status"] == "completed"
        done_by_then = _view(runtime, big)["counts"]["completed"]
        assert done_by_then < BIG // 2, done_by_then
        assert (await _until(runtime, big))["status"] == "completed"
    finally:
        await runtime.stop()


async def test_priority_first_in_the_embedded_executor_too(committed: Engine) -> None:
    runtime, big = await _big_job_under_way(committed)
    try:
        later = await _submit(runtime, "later", 10, owner="beta", priority=5)
        urgent = await _submit(runtime, "urgent", 10, owner="acme", priority=-1)
        assert (await _until(runtime, urgent))["status"] == "completed"
        assert _view(runtime, big)["counts"]["completed"] < BIG // 2
        assert (await _until(runtime, later))["status"] == "completed"
        # the less urgent job's items started only as the big job ran out of items to start
        assert _view(runtime, big)["counts"]["completed"] >= BIG - 8 - 10
        assert (await _until(runtime, big))["status"] == "completed"
    finally:
        await runtime.stop()
