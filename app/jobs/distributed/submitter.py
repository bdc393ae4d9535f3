"""The server's job dispatcher, for either transport: it writes each submitted job's node rows after the
submission committed (several jobs at once, so a 50,000-item job's rows do not hold a small job's back),
refills the dispatch windows on every tick, and finishes cancelled jobs once their nodes stopped. Cancelling
stops dispatching at once: node tasks of a job that is not open neither run nor release their dependents, and
the windows send nothing more of it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from app.aio import wait_event
from app.db import JobStatus, repository, session_scope
from app.jobs.distributed.dispatch import dispatch_job
from app.jobs.distributed.events import JobEvents
from app.jobs.distributed.messages import Dispatcher, Endpoints
from app.jobs.distributed.node_task import NodePolicy
from app.jobs.distributed.settle import settle_job
from app.jobs.distributed.window import DispatchWindow

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
        window: DispatchWindow | None = None,
        max_dispatching: int = 4,
        on_cancelling: Callable[[str], None] | None = None,
    ) -> None:
        """``on_cancelling(job_id)``: called on every tick for each cancelling job before it is settled (the
        in-process queue cancels the job's running calls; workers' calls end by themselves)."""
        self.sessions = sessions
        self.dispatcher = dispatcher
        self.endpoints = endpoints
        self.events = events
        self.policy = policy or NodePolicy()
        self.poll_interval = poll_interval
        self.window = window or DispatchWindow.fixed(sessions, dispatcher, self.policy.stale_s)
        self.max_dispatching = max_dispatching
        self.on_cancelling = on_cancelling
        self._dispatching: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="job-dispatch")

    def wake(self) -> None:
        """A job was submitted or cancelled: look now."""
        self._wake.set()

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._dispatching.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._dispatching.clear()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # the database or the broker may be briefly away: the next tick tries again
                log.exception("dispatching jobs to the workers failed; retrying")
            await wait_event(self._wake, self.poll_interval)

    async def tick(self) -> None:
        """Start writing the node rows of queued jobs (most urgent first, a few jobs at once), refill the dispatch
        windows, and finish cancelled jobs whose nodes stopped."""
        queued, cancelling = await asyncio.to_thread(self._pending)
        for job_id in queued:
            if job_id not in self._dispatching and len(self._dispatching) < self.max_dispatching:
                self._dispatching[job_id] = asyncio.get_running_loop().create_task(
                    self._dispatch(job_id), name=f"dispatch-{job_id}"
                )
        await asyncio.to_thread(self.window.refill)
        for job_id in cancelling:
            if self.on_cancelling is not None:
                self.on_cancelling(job_id)
            if await asyncio.to_thread(self._settle, job_id) == JobStatus.CANCELLED:
                self.events.publish(job_id)

    async def _dispatch(self, job_id: str) -> None:
        try:
            await asyncio.to_thread(
                dispatch_job, self.sessions, job_id, self.dispatcher, self.endpoints, self.policy, window=self.window
            )
            self.events.publish(job_id)
        except Exception:  # the job stays queued or running: the sweeper (or the next tick) continues it
            log.exception("job %s: dispatching failed; retrying", job_id)
        finally:
            self._dispatching.pop(job_id, None)
            self._wake.set()  # a dispatch slot is free

    def _pending(self) -> tuple[list[str], list[str]]:
        with session_scope(self.sessions) as session:
            queued = [j.id for j in repository.jobs_with_status(session, statuses=[JobStatus.QUEUED])]
            cancelling = [j.id for j in repository.jobs_with_status(session, statuses=[JobStatus.CANCELLING])]
            return queued, cancelling

    def _settle(self, job_id: str) -> str | None:
        with session_scope(self.sessions) as session:
            return settle_job(session, job_id)
