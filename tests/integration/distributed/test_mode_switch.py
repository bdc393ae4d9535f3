"""One way to run a job: a job the embedded mode started is finished by Celery workers, and a job workers started
is finished by the embedded mode, through the real stores (PostgreSQL, Redis, the fake endpoint at 50 ms a call),
with every item finished once and every node stored once."""

from __future__ import annotations

import asyncio
import signal

import pytest
from sqlalchemy import func, select

from app.db import make_session_factory, session_scope
from app.db.models import NodeTask
from app.jobs.registry import configure_registry
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.cluster import Cluster, wait_until

ITEMS = 300
CALLS_PER_ITEM = 3  # review-compare: praise, complaints, verdict (the render op between runs inline)
NODES_PER_ITEM = 4


def _inputs(n: int) -> list[dict[str, str]]:
    return [{"custom_id": f"doc-{i:04d}", "input": f"review {i}: crisp sound, short battery life"} for i in range(n)]


def _embedded_settings(cluster: Cluster) -> Settings:
    """The cluster's settings without Redis: ``inf-engine serve`` in the embedded mode on the same database."""
    settings = cluster.settings
    return settings.model_copy(update={"redis_url": None, "jobs_poll_interval": 0.1, "sweep_interval": 1.0})


def _completed(cluster: Cluster, job_id: str) -> int:
    return int(cluster.view(job_id)["counts"]["completed"])


def _claimed(cluster: Cluster, job_id: str) -> int:
    with session_scope(make_session_factory(cluster.engine)) as session:
        stmt = select(func.count()).select_from(NodeTask).where(NodeTask.job_id == job_id,
                                                                NodeTask.status == "running")
        return int(session.scalar(stmt) or 0)


async def _run_embedded_until(cluster: Cluster, job_id: str, done: int) -> None:
    """The server's in-process queue runs the job until ``done`` items completed, then the server stops."""
    runtime = JobsRuntime(_embedded_settings(cluster))
    await runtime.ensure_started()
    assert runtime.executor is not None  # the in-process queue, not a dispatcher to workers
    try:
        for _ in range(1200):
            if await asyncio.to_thread(_completed, cluster, job_id) >= done:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the embedded mode did not complete {done} items: {cluster.view(job_id)}")
    finally:
        await runtime.stop()


@pytest.mark.timeout(300)
def test_a_job_started_embedded_is_finished_by_workers(cluster: Cluster) -> None:
    configure_registry(cluster.settings.pipeline_modules)
    job_id = cluster.submit("review-compare", _inputs(ITEMS), dispatch=False)
    asyncio.run(_run_embedded_until(cluster, job_id, ITEMS // 5))
    assert _completed(cluster, job_id) < ITEMS
    cluster.start("beat")  # its sweeper sends what the stopped server had queued
    cluster.start_worker("finisher")
    cluster.wait(job_id, 180)
    cluster.assert_exactly_once(job_id, ITEMS, NODES_PER_ITEM)
    # calls cut short by the server's stop (at most its calls in flight) reach the endpoint twice; nothing else does
    in_flight_cap = cluster.settings.default_max_concurrent
    assert CALLS_PER_ITEM * ITEMS <= cluster.fake_stats()["total"] <= CALLS_PER_ITEM * ITEMS + in_flight_cap


@pytest.mark.timeout(300)
def test_a_job_started_on_workers_is_finished_embedded_after_a_sigkill(cluster: Cluster) -> None:
    doomed = cluster.start_worker("doomed")
    job_id = cluster.submit("review-compare", _inputs(ITEMS))
    wait_until(lambda: _completed(cluster, job_id) >= ITEMS // 3, 120, "a third of the items")
    cluster.stop(doomed, signal.SIGKILL)
    in_flight = _claimed(cluster, job_id)
    assert _completed(cluster, job_id) < ITEMS
    asyncio.run(_run_embedded_until(cluster, job_id, ITEMS))
    cluster.assert_exactly_once(job_id, ITEMS, NODES_PER_ITEM)
    duplicates = cluster.fake_stats()["total"] - CALLS_PER_ITEM * ITEMS
    assert 0 <= duplicates <= in_flight, (duplicates, in_flight)
