"""The embedded mode (node tasks on the server's in-process queue) on PostgreSQL with a scripted LLM: lifecycle, checkpoints, resume, cancel, failures."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import Engine, func, select

from app.db import Item, JobStatus, NodeResult, repository
from app.db.models import NodeTask
from app.jobs.runtime import JobsRuntime
from app.jobs.service import describe_job, results_page
from app.jobs.submission import JobRequest, submit_job
from app.pipeline.resources.types import LLMRequest, LLMResponse
from app.settings import Settings
from tests.support.fakes import ScriptedLM


def _settings(engine: Engine, **overrides: Any) -> Settings:
    url = engine.url.render_as_string(hide_password=False)
    return Settings(database_url=url, jobs_poll_interval=0.05, **overrides)


async def _submit(runtime: JobsRuntime, n: int, **kw: Any) -> str:
    inputs = [{"custom_id": f"r{i}", "input": {"review": f"review {i}"}} for i in range(n)]

    def work() -> str:
        with runtime.session() as session:
            return submit_job(session, JobRequest("review-compare", inputs=inputs, **kw))[0].id

    job_id = await asyncio.to_thread(work)
    runtime.wake()
    return job_id


async def _wait_for(runtime: JobsRuntime, job_id: str, statuses: set[str], timeout: float = 10.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        with runtime.session() as session:
            view = describe_job(session, job_id)
        if view["status"] in statuses:
            return view
        assert asyncio.get_running_loop().time() < deadline, f"job stuck in {view['status']}: {view}"
        await asyncio.sleep(0.05)


class GatedLM(ScriptedLM):
    """Verdict prompts wait for ``gate``; everything else answers at once."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.gate = asyncio.Event()

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        if "Verdict:" in str(request.prompt):
            await self.gate.wait()
        return await super().complete(alias, request)


async def test_job_runs_to_completion_with_checkpoints_metrics_and_trace(committed: Engine) -> None:
    lm = ScriptedLM()
    runtime = JobsRuntime(_settings(committed), resources=lm)
    await runtime.ensure_started()
    try:
        job_id = await _submit(runtime, 5)
        view = await _wait_for(runtime, job_id, {"completed", "failed"})
    finally:
        await runtime.stop()
    assert view["status"] == "completed", view
    assert view["counts"] == {"total": 5, "completed": 5, "failed": 0, "cancelled": 0, "pending": 0}
    assert view["started_at"] is not None and view["completed_at"] is not None
    assert view["usage"]["llm_calls"] == 15 and view["usage"]["input_tokens"] > 0
    assert len(lm.calls) == 15
    runtime2 = JobsRuntime(_settings(committed), resources=lm, run_executor=False)
    await runtime2.ensure_started()
    with runtime2.session() as session:
        page = results_page(session, job_id)
        assert page.finished and len(page.lines) == 5
        line = next(li for li in page.lines if li["custom_id"] == "r3")
        assert line["status"] == "completed"
        assert set(line["output"]) == {"liked", "disliked", "verdict"}
        assert "review 3" in line["output"]["liked"]
        stored = session.scalar(select(func.count()).select_from(NodeResult).where(NodeResult.job_id == job_id))
        llm_rows = session.scalar(select(func.count()).select_from(NodeResult).where(
            NodeResult.job_id == job_id, NodeResult.node_id.like("LLMInference%")))
        assert llm_rows == 15 and stored is not None and stored >= 15
        metrics = repository.get_job_metrics(session, job_id=job_id)
        assert metrics is not None and metrics.trace is not None
        names = {e.get("name") for e in metrics.trace["traceEvents"]}
        assert any(name and "LLMInference" in name for name in names)
        attempts = session.scalars(select(NodeTask.attempts).where(
            NodeTask.job_id == job_id, NodeTask.kind == "llm")).all()
        assert len(attempts) == 15 and set(attempts) == {1}  # every call ran once (ops run inline, unclaimed)
    await runtime2.stop()


async def test_stopped_job_resumes_without_rerunning_stored_nodes(committed: Engine) -> None:
    first = GatedLM()
    runtime = JobsRuntime(_settings(committed), resources=first)
    await runtime.ensure_started()
    job_id = await _submit(runtime, 4)
    # praise and complaints of every item finish; the verdicts wait at the gate
    for _ in range(200):
        with runtime.session() as session:
            count = repository.count_node_results(session, job_id=job_id)
        if len(first.calls) >= 8 and count >= 8:
            break
        await asyncio.sleep(0.05)
    await runtime.stop()  # like a shutdown: the job stays running
    with runtime.session() as session:
        assert describe_job(session, job_id)["status"] == "running"
    second = ScriptedLM()
    resumed = JobsRuntime(_settings(committed), resources=second)
    await resumed.ensure_started()
    try:
        view = await _wait_for(resumed, job_id, {"completed", "failed"})
    finally:
        await resumed.stop()
    assert view["status"] == "completed", view
    assert len(second.calls) == 4, second.prompts()  # only the four verdicts ran again
    assert all("Verdict:" in str(prompt) for prompt in second.prompts())
    with resumed.session() as session:  # the verdicts were claimed by both servers, every other node by the first
        attempts = session.scalars(select(NodeTask.attempts).where(
            NodeTask.job_id == job_id, NodeTask.kind == "llm")).all()
    assert len(attempts) == 12 and set(attempts) <= {1, 2}  # a verdict the first server had claimed: 2


class OnlyFirstItemLM(ScriptedLM):
    """Requests about review 0 are answered; every other request hangs until cancelled."""

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        if "review 0" not in str(request.prompt):
            await asyncio.Event().wait()
        return await super().complete(alias, request)


async def test_cancel_keeps_finished_results(committed: Engine) -> None:
    from app.jobs.service import cancel_job

    runtime = JobsRuntime(_settings(committed), resources=OnlyFirstItemLM())
    await runtime.ensure_started()
    try:
        job_id = await _submit(runtime, 6)
        await _wait_for_results(runtime, job_id, 0)
        with runtime.session() as session:
            assert cancel_job(session, job_id).status == JobStatus.CANCELLING
        runtime.wake()
        view = await _wait_for(runtime, job_id, {"cancelled"})
    finally:
        await runtime.stop()
    assert view["cancelled_at"] is not None and view["cancelling_at"] is not None
    assert view["counts"] == {"total": 6, "completed": 1, "failed": 0, "cancelled": 5, "pending": 0}
    with runtime.session() as session:
        page = results_page(session, job_id)
    assert page.finished and page.lines[0]["custom_id"] == "r0" and page.lines[0]["status"] == "completed"
    assert [line["status"] for line in page.lines[1:]] == ["cancelled"] * 5


async def _wait_for_results(runtime: JobsRuntime, job_id: str, at_least: int) -> None:
    for _ in range(200):
        with runtime.session() as session:
            if len(results_page(session, job_id).lines) > at_least:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("no result arrived")


async def test_missing_endpoint_fails_the_job_with_a_clear_error(committed: Engine) -> None:
    from app.pipeline.resources import ResourceConfig, ResourceManager

    other = ResourceManager(ResourceConfig({"other": {"provider": "openai", "model": "m",
                                                      "base_url": "http://127.0.0.1:9/v1"}}))
    runtime = JobsRuntime(_settings(committed), resources=other)
    await runtime.ensure_started()
    try:
        job_id = await _submit(runtime, 2)
        view = await _wait_for(runtime, job_id, {"failed", "completed"})
    finally:
        await runtime.stop()
    assert view["status"] == "failed"
    assert "INF_ENGINE_RESOURCES_FILE" in view["error"]["message"] and "assistant" in view["error"]["message"]
    assert view["counts"]["failed"] == 2


async def test_queued_jobs_run_by_priority(committed: Engine) -> None:
    lm = ScriptedLM(latency=0.01)
    runtime = JobsRuntime(_settings(committed, jobs_max_running=1), resources=lm, run_executor=False)
    await runtime.ensure_started()
    low = await _submit(runtime, 1, priority=5)
    high = await _submit(runtime, 1, priority=-1)
    await runtime.stop()
    runner = JobsRuntime(_settings(committed, jobs_max_running=1), resources=lm)
    await runner.ensure_started()
    try:
        await _wait_for(runner, low, {"completed"})
        await _wait_for(runner, high, {"completed"})
        with runner.session() as session:
            a = repository.get_job(session, job_id=high)
            b = repository.get_job(session, job_id=low)
            assert a is not None and b is not None and a.started_at is not None and b.started_at is not None
            assert a.started_at <= b.started_at
    finally:
        await runner.stop()


async def test_an_item_interrupted_too_often_fails_instead_of_looping(committed: Engine) -> None:
    from sqlalchemy import update

    from app.jobs.distributed import Endpoints, dispatch_job
    from app.jobs.distributed.transport.inprocess import InProcessDispatcher
    from app.jobs.distributed.transport.queues import Queues

    lm = ScriptedLM()
    runtime = JobsRuntime(_settings(committed), resources=lm, run_executor=False)
    await runtime.ensure_started()
    job_id = await _submit(runtime, 2)
    # the node rows, as a server writes them; then r0's first nodes look as if five servers had died running them
    await asyncio.to_thread(dispatch_job, runtime.sessions, job_id, InProcessDispatcher(Queues.from_prefix()),
                            Endpoints(None))
    with runtime.session() as session:
        r0 = session.scalar(select(Item.id).where(Item.job_id == job_id, Item.custom_id == "r0"))
        session.execute(update(NodeTask).where(NodeTask.item_id == r0, NodeTask.status == "queued")
                        .values(status="running", attempts=5))
    await runtime.stop()
    runner = JobsRuntime(_settings(committed), resources=lm)
    await runner.ensure_started()
    try:
        view = await _wait_for(runner, job_id, {"completed", "failed"})
        with runner.session() as session:
            lines = {line["custom_id"]: line for line in results_page(session, job_id).lines}
    finally:
        await runner.stop()
    assert view["status"] == "completed" and view["counts"]["failed"] == 1
    assert lines["r0"]["error"]["type"] == "TooManyAttempts" and lines["r1"]["status"] == "completed"
    assert len(lm.calls) == 3  # r0 did not run again
