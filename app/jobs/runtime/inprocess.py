"""The embedded mode: the server runs node tasks itself, on its in-process queue, with the same node runtime a
Celery worker builds (:func:`app.jobs.distributed.worker.build_node_worker`). The job dispatcher writes node rows
and refills the dispatch windows as it does for workers, and a sweeper runs every ``sweep_interval`` here instead
of in beat."""

from __future__ import annotations

import asyncio
import gc
import logging
from functools import partial
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope
from app.db.direct import DirectPool
from app.db.repository import node_tasks as tasks_repo
from app.jobs.distributed import NodeCall, NodeMessage, NodeWorker, run_node, sweep
from app.jobs.distributed.events import JobEvents
from app.jobs.distributed.submitter import DistributedJobs
from app.jobs.distributed.transport.inprocess import InProcessDispatcher, InProcessNodes, LoopSubmit
from app.jobs.distributed.transport.queues import Queues, node_task_id
from app.jobs.distributed.worker import build_node_worker, endpoints_of, node_policy, open_node_database
from app.settings import Settings

log = logging.getLogger(__name__)

# A refill costs one short transaction here and no broker round trip, and a message waits in memory, not in
# Redis: refill more often than workers do, so threads do not wait for work between two refills.
REFILL_COALESCE_S = 0.1


def _freeze_heap() -> None:
    """What the server holds once its runtime is up (modules, the app, engines, pipelines) lives as long as it
    does: moved out of the cyclic collector's reach, so that its full passes, which stop every thread (~100 ms on
    this heap), scan only what node tasks allocate since. :meth:`InProcessJobs.stop` lets it go again."""
    gc.collect()
    gc.freeze()


class InProcessJobs:
    """Node tasks run by ``settings.jobs_threads`` threads of this process (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        resources_for: Any,
        events: JobEvents,
    ) -> None:
        """``sessions``: the server's (the job dispatcher's and sweeper's); the node tasks get pools of their own
        as a worker's (:func:`~app.jobs.distributed.worker.open_node_database`)."""
        self.settings = settings
        self.sessions = sessions
        self.resources_for = resources_for
        self.events = events
        self._node_db: tuple[sessionmaker[Session], DirectPool | None] | None = None
        self.dispatcher = InProcessDispatcher(
            Queues.from_prefix(settings.celery_queue_prefix), group=settings.node_group
        )
        self.worker: NodeWorker | None = None
        self.nodes: InProcessNodes | None = None
        self.jobs: DistributedJobs | None = None
        self._submit: LoopSubmit | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        settings = self.settings
        self._submit = LoopSubmit(loop)
        self.nodes = InProcessNodes(
            self.dispatcher, self._deliver, threads=settings.jobs_threads,
            on_done=lambda m: self._publish(loop, m.job_id),
        )
        self._node_db = await asyncio.to_thread(partial(open_node_database, settings, threads=settings.jobs_threads))
        self.worker = build_node_worker(
            settings, self.dispatcher, self._submit, resources_for=self.resources_for,
            max_calls=settings.default_max_concurrent, database=self._node_db, capacity=self.nodes.capacity,
            coalesce_s=REFILL_COALESCE_S,
        )
        taken_back = await asyncio.to_thread(self._take_back)
        if taken_back:
            log.info("resuming: %d node task(s) a previous run of this server left in flight are queued again",
                     taken_back)
        self.nodes.start()
        _freeze_heap()
        endpoints = endpoints_of(settings, defines=getattr(self.resources_for, "defines", None))
        self.jobs = DistributedJobs(
            self.sessions, self.dispatcher, endpoints, events=self.events, policy=node_policy(settings),
            poll_interval=settings.jobs_poll_interval, window=self.worker.window,
            max_dispatching=settings.jobs_max_running, on_cancelling=self._submit.cancel_job,
        )
        await self.jobs.start()
        self._sweeper = loop.create_task(self._sweep_loop(), name="in-process-sweeper")

    def wake(self) -> None:
        if self.jobs is not None:
            self.jobs.wake()

    async def stop(self) -> None:
        gc.unfreeze()  # what it held may go now (a test's server, a runtime started again)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self.jobs is not None:
            await self.jobs.stop()
        if self._submit is not None:
            self._submit.cancel_all()  # the calls in flight end now; their nodes are taken back at next start
        if self.nodes is not None:
            await self.nodes.stop()
        if self.worker is not None:
            if self.worker.window is not None:
                self.worker.window.close()
            close = getattr(self.worker.store, "close", None)
            if callable(close):
                close()
        if self._node_db is not None:
            sessions, direct = self._node_db
            if direct is not None:
                direct.close()
            sessions.kw["bind"].dispose()
            self._node_db = None

    def _publish(self, loop: asyncio.AbstractEventLoop, job_id: str) -> None:
        """A delivery ended: followers of the job look now (from a task thread, onto the server's loop)."""
        if not loop.is_closed():
            loop.call_soon_threadsafe(self.events.publish, job_id)

    # -- the node task ------------------------------------------------------------------------------------------
    def _deliver(self, message: NodeMessage) -> None:
        assert self.worker is not None
        token = node_task_id(message.job_id, message.item_id, message.node_id, message.attempt)
        call = NodeCall(message.job_id, message.item_id, message.node_id, message.attempt, token)
        assert self._submit is not None
        self._submit.delivering(message.job_id)
        try:
            run_node(self.worker, call, here=message.queue, also=message.also)
        finally:
            self._submit.delivering(None)

    def _take_back(self) -> int:
        with session_scope(self.sessions) as session:
            return tasks_repo.take_back_in_flight(session)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            try:
                await asyncio.to_thread(self._sweep)
            except Exception:  # the database may be briefly away: the next sweep tries again
                log.exception("the in-process sweep failed; retrying")

    def _sweep(self) -> None:
        worker = self.worker
        assert worker is not None and self.jobs is not None
        sweep(self.sessions, self.dispatcher, self.jobs.endpoints, worker.policy,
              resources_for=self.resources_for, window=worker.window)
