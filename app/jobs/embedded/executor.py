"""The embedded executor: runs jobs inside the server process (issue 6 moves node execution to Celery).

A background task claims queued jobs (by the fair-share policy of :mod:`app.jobs.limits.fairness`: lowest
priority value first, then the tenant with the fewest running jobs, then the oldest), runs up to
``jobs_max_running`` of them at once, finishes cancelled ones, and at start resumes the jobs that were running
when the previous server process ended. The running jobs' items in flight share one :class:`FairGate` (its
capacity: ``dispatch_window``, else twice the endpoints' ``max_concurrent``, at least 32), so a small job of
another tenant starts its items as soon as a slot frees instead of queueing behind a big job's. It assumes it
is the only executor on its database.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.aio import wait_event
from app.db import JobStatus, repository, session_scope
from app.jobs.embedded.events import JobEvents
from app.jobs.embedded.runner import JobRun, ResourcesFor, RunOptions, finish_cancelled
from app.jobs.limits.fairness import Demand, FairGate, next_job

log = logging.getLogger(__name__)


class EmbeddedExecutor:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        resources_for: ResourcesFor,
        events: JobEvents,
        max_running: int = 4,
        poll_interval: float = 1.0,
        options: RunOptions | None = None,
        gate: FairGate | None = None,
    ) -> None:
        self.sessions = sessions
        self.resources_for = resources_for
        self.events = events
        self.max_running = max_running
        self.poll_interval = poll_interval
        self.options = options or RunOptions()
        self.gate = gate or FairGate(self.options.window)
        self.runs: dict[str, JobRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        resumed = await asyncio.to_thread(self._running_job_ids)
        for job_id in resumed:
            log.info("resuming job %s", job_id)
            self._launch(job_id)
        self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name="embedded-executor")

    def wake(self) -> None:
        """Look for new or cancelled jobs now (the API calls this after a submit or a cancel)."""
        self._wake.set()

    def live_trace(self, job_id: str) -> dict[str, Any] | None:
        run = self.runs.get(job_id)
        return run.live_trace() if run is not None else None

    async def stop(self) -> None:
        """Interrupt every run without changing job statuses: the next start resumes them."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for run in self.runs.values():
            run.stop()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # -- the loop -----------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # the database may be briefly unavailable: try again on the next tick
                log.exception("the embedded executor's tick failed; retrying")
            await wait_event(self._wake, self.poll_interval)
            self._wake.clear()

    async def _tick(self) -> None:
        cancelling = await asyncio.to_thread(self._cancelling_job_ids)
        for job_id in cancelling:
            run = self.runs.get(job_id)
            if run is not None:
                run.cancel()
            else:
                await asyncio.to_thread(finish_cancelled, self.sessions, job_id)
                self.events.publish(job_id)
        while len(self.runs) < self.max_running:
            claimed = await asyncio.to_thread(self._claim)
            if claimed is None:
                break
            self._launch(claimed)
            self.events.publish(claimed)

    def _launch(self, job_id: str) -> None:
        run = JobRun(job_id, self.sessions, resources_for=self.resources_for, events=self.events,
                     options=self.options, gate=self.gate)
        self.runs[job_id] = run
        task = asyncio.get_running_loop().create_task(self._run(run), name=f"job-{job_id}")
        self._tasks[job_id] = task

    async def _run(self, run: JobRun) -> None:
        try:
            await run.run()
        except Exception:
            log.exception("job %s: the run failed", run.job_id)
        finally:
            self.runs.pop(run.job_id, None)
            self._tasks.pop(run.job_id, None)
            self._wake.set()  # a slot is free: claim the next job

    # -- database steps (worker thread) -------------------------------------------------------------------
    def _running_job_ids(self) -> list[str]:
        with session_scope(self.sessions) as session:
            return [j.id for j in repository.jobs_with_status(session, statuses=[JobStatus.RUNNING], kind=None)]

    def _cancelling_job_ids(self) -> list[str]:
        with session_scope(self.sessions) as session:
            return [j.id for j in repository.jobs_with_status(session, statuses=[JobStatus.CANCELLING], kind=None)]

    def _claim(self) -> str | None:
        """The next queued job to run, fairly between tenants (see the module docstring)."""
        with session_scope(self.sessions) as session:
            demands = [
                Demand(j.id, j.owner, j.priority, int(j.status != JobStatus.QUEUED),
                       int(j.status == JobStatus.QUEUED and j.id not in self.runs), j.created_at.timestamp())
                for j in repository.jobs_with_status(
                    session, statuses=[JobStatus.QUEUED, JobStatus.RUNNING], kind=None
                )
            ]
            while (job_id := next_job(demands, weights=self.gate.weights)) is not None:
                if repository.claim_job(session, job_id=job_id):
                    return job_id
                demands = [d for d in demands if d.job_id != job_id]  # cancelled meanwhile
            return None
