"""What a server process needs for jobs: the database (migrated on first use), the in-process event hub, the
endpoints, and who runs the node tasks: Celery workers (a dispatcher is given; this process dispatches) or this
process's in-process queue (the embedded mode). The API creates one ``JobsRuntime`` per app and starts it in the
app's lifespan.

A server that never touches jobs must not create a database: the runtime starts at boot only when a database
is configured or the embedded SQLite file already exists (then it has jobs to resume); otherwise the first
jobs request starts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.db import JobStatus, create_db_engine, database_url, make_session_factory, repository, session_scope
from app.db.session import sqlite_path
from app.jobs.distributed.events import JobEvents
from app.jobs.distributed.trace import job_trace
from app.jobs.endpoints import EndpointResolver
from app.jobs.limits.quotas import QuotaTable
from app.jobs.runtime.inprocess import InProcessJobs
from app.jobs.submission import Limits
from app.settings import Settings

if TYPE_CHECKING:
    from app.jobs.distributed.submitter import DistributedJobs

log = logging.getLogger(__name__)


class JobsRuntime:
    def __init__(
        self,
        settings: Settings,
        *,
        resources: Any = None,
        backend: Any = None,
        run_executor: bool = True,
        dispatcher: Any = None,
    ) -> None:
        """``resources``: a ResourceManager (or a scripted stand-in) for the pipelines' endpoints. By default
        one is built from ``settings.resources_file``; without that file every alias a pipeline calls goes to
        ``backend`` (the server's own, started Backend) or, without one, to the in-process engine of
        ``settings.model`` (the default SmolLM2). ``run_executor=False`` serves the API without running jobs
        (another process runs them). ``dispatcher`` (an ``app.jobs.distributed.Dispatcher``, e.g. Celery's when
        Redis is configured): jobs run on workers instead, and this process dispatches their first nodes."""
        self.settings = settings
        self.url = database_url(settings)
        self.events = JobEvents()
        self.limits = Limits(max_items=settings.jobs_max_items, max_bytes=settings.jobs_max_bytes,
                             quotas=QuotaTable.from_settings(settings))
        self.resources_for = EndpointResolver(settings, resources=resources, backend=backend)
        self._run_executor = run_executor
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self.executor: InProcessJobs | None = None  # the embedded mode's node tasks
        self._dispatcher = dispatcher
        self.distributed: DistributedJobs | None = None
        self._lock = asyncio.Lock()
        self._stopped = False

    # -- lifecycle ----------------------------------------------------------------------------------------
    def has_state(self) -> bool:
        """A database is configured, or the embedded one exists already."""
        if self.settings.database_url:
            return True
        path = sqlite_path(self.url)
        return path is not None and path.exists()

    async def start_if_configured(self) -> None:
        """Start at boot when there may be jobs to resume. A database that is down must not keep the server
        (and its OpenAI routes) from starting: the first jobs request tries again."""
        if not self.has_state():
            return
        try:
            await self.ensure_started()
        except Exception as exc:
            log.error("jobs are unavailable until the database is reachable (%s: %s); the first /v1/jobs "
                      "request will try again", type(exc).__name__, exc)

    async def ensure_started(self) -> None:
        if self.executor is not None or self.distributed is not None:
            return
        if self._sessions is not None and not self._run_executor:
            return
        async with self._lock:
            if self._sessions is None:
                await asyncio.to_thread(self._open_database)
            if not self._run_executor or self._stopped:
                return
            if self._dispatcher is not None:
                if self.distributed is None:
                    await self._start_distributed()
            elif self.executor is None:
                executor = InProcessJobs(self.settings, self.sessions, resources_for=self.resources_for,
                                         events=self.events)
                await executor.start()  # resumes interrupted jobs; set only once that worked
                self.executor = executor

    async def _start_distributed(self) -> None:
        from app.jobs.distributed.submitter import DistributedJobs
        from app.jobs.distributed.worker import dispatch_window, endpoints_of, node_policy

        endpoints = endpoints_of(self.settings)
        distributed = DistributedJobs(
            self.sessions, self._dispatcher, endpoints, events=self.events,
            policy=node_policy(self.settings), poll_interval=self.settings.jobs_poll_interval,
            max_dispatching=self.settings.jobs_max_running,
            window=dispatch_window(self.settings, self.sessions, self._dispatcher, endpoints),
        )
        await distributed.start()
        self.distributed = distributed

    async def stop(self) -> None:
        self._stopped = True
        if self.distributed is not None:
            await self.distributed.stop()
            self.distributed = None
        if self.executor is not None:
            await self.executor.stop()
            self.executor = None
        await self.resources_for.aclose()
        if self._engine is not None:
            self._engine.dispose()

    def _open_database(self) -> None:
        if self.settings.db_auto_upgrade:
            from app.db.migrate import upgrade

            upgrade(self.url)
        self._engine = create_db_engine(self.url)
        self._sessions = make_session_factory(self._engine)

    # -- access -------------------------------------------------------------------------------------------
    @property
    def sessions(self) -> sessionmaker[Session]:
        if self._sessions is None:
            raise RuntimeError("the jobs runtime is not started: await ensure_started() first")
        return self._sessions

    @contextmanager
    def session(self) -> Iterator[Session]:
        with session_scope(self.sessions) as session:
            yield session

    def wake(self) -> None:
        if self.executor is not None:
            self.executor.wake()
        if self.distributed is not None:
            self.distributed.wake()

    @staticmethod
    def live_trace(session: Session, job_id: str) -> dict[str, Any] | None:
        """The running job's trace so far, from its node rows (a finished job's is stored when it ends). On the
        caller's session: a second transaction beside the route's would wait on SQLite's write lock."""
        job = repository.get_job(session, job_id=job_id)
        if job is None or job.status not in (JobStatus.RUNNING, JobStatus.CANCELLING):
            return None
        return job_trace(session, job_id)
