"""The API process's side of distributed jobs: instead of running jobs (the embedded executor), it dispatches
each submitted job's first nodes to the workers after the submission committed, and finishes cancelled jobs
once their workers stopped. Cancelling stops dispatching at once: node tasks of a job that is not open neither
run nor send their dependents."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.orm import Session, sessionmaker

from app.aio import wait_event
from app.db import JobStatus, repository, session_scope
from app.jobs.distributed.dispatch import dispatch_job
from app.jobs.distributed.messages import Dispatcher, Endpoints
from app.jobs.distributed.node_task import NodePolicy
from app.jobs.distributed.settle import settle_job
from app.jobs.embedded.events import JobEvents

log = logging.getLogger(__name__)


class DistributedJobs:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        dispatcher: Dispatcher,
        endpoints: Endpoints,
        *,
        events: JobEvents,
        policy: NodePolicy | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        self.sessions = sessions
        self.dispatcher = dispatcher
        self.endpoints = endpoints
        self.events = events
        self.policy = policy or NodePolicy()
        self.poll_interval = poll_interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="job-dispatch")

    def wake(self) -> None:
        """A job was submitted or cancelled: look now."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # the database or the broker may be briefly away: the next tick tries again
                log.exception("dispatching jobs to the workers failed; retrying")
            await wait_event(self._wake, self.poll_interval)

    async def tick(self) -> None:
        """Dispatch queued jobs (most urgent first) and finish cancelled jobs whose nodes stopped."""
        queued, cancelling = await asyncio.to_thread(self._pending)
        for job_id in queued:
            await asyncio.to_thread(dispatch_job, self.sessions, job_id, self.dispatcher, self.endpoints,
                                    self.policy)
            self.events.publish(job_id)
        for job_id in cancelling:
            if await asyncio.to_thread(self._settle, job_id) == JobStatus.CANCELLED:
                self.events.publish(job_id)

    def _pending(self) -> tuple[list[str], list[str]]:
        with session_scope(self.sessions) as session:
            queued = [j.id for j in repository.jobs_with_status(session, statuses=[JobStatus.QUEUED])]
            cancelling = [j.id for j in repository.jobs_with_status(session, statuses=[JobStatus.CANCELLING])]
            return queued, cancelling

    def _settle(self, job_id: str) -> str | None:
        with session_scope(self.sessions) as session:
            return settle_job(session, job_id)
