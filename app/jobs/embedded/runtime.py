"""What a server process needs for jobs: the database (migrated on first use), the in-process event hub and
the embedded executor. The API creates one ``JobsRuntime`` per app and starts it in the app's lifespan.

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

from app.db import create_db_engine, database_url, make_session_factory, session_scope
from app.db.session import sqlite_path
from app.jobs.embedded.events import JobEvents
from app.jobs.embedded.executor import EmbeddedExecutor
from app.jobs.embedded.runner import RunOptions
from app.jobs.limits.fairness import FairGate, endpoints_cap
from app.jobs.limits.quotas import QuotaTable
from app.jobs.submission import Limits
from app.pipeline.resources.config import ResourceConfig
from app.settings import Settings

if TYPE_CHECKING:
    from app.jobs.distributed.submitter import DistributedJobs

MIN_GATE = 32  # items in flight the embedded executor's gate allows at least
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
        self._resources = resources
        self._backend = backend
        self._managers: dict[tuple[str, ...], Any] = {}  # what this runtime created (and closes)
        self._run_executor = run_executor
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self.executor: EmbeddedExecutor | None = None
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
            if self._dispatcher is not None:
                if self._run_executor and self.distributed is None and not self._stopped:
                    await self._start_distributed()
                return
            if self._run_executor and self.executor is None and not self._stopped:
                executor = EmbeddedExecutor(
                    self.sessions,
                    resources_for=self.resources_for,
                    events=self.events,
                    max_running=self.settings.jobs_max_running,
                    poll_interval=self.settings.jobs_poll_interval,
                    options=RunOptions(max_concurrent=self.settings.default_max_concurrent),
                    gate=self._fair_gate(),
                )
                await executor.start()  # resumes interrupted jobs; set only once that worked
                self.executor = executor

    def _fair_gate(self) -> FairGate:
        """The executor's items in flight, shared fairly between jobs and tenants: ``dispatch_window`` items, else
        twice the endpoints' max_concurrent (at least 32), else the per-job window."""
        settings = self.settings
        size = settings.dispatch_window
        if not size:
            config = None
            if settings.resources_file is not None:
                config = ResourceConfig.from_file(settings.resources_file)
            cap = endpoints_cap(config)
            size = max(MIN_GATE, cap) if cap else RunOptions().window
        return FairGate(size, weights=settings.tenant_weights)

    async def _start_distributed(self) -> None:
        from app.jobs.distributed.submitter import DistributedJobs
        from app.jobs.distributed.worker import dispatch_window, endpoints_of, node_policy

        endpoints = endpoints_of(self.settings)
        distributed = DistributedJobs(
            self.sessions, self._dispatcher, endpoints, events=self.events,
            policy=node_policy(self.settings), poll_interval=self.settings.jobs_poll_interval,
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
        for manager in self._managers.values():
            await manager.aclose()
        self._managers.clear()
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

    def live_trace(self, job_id: str) -> dict[str, Any] | None:
        return self.executor.live_trace(job_id) if self.executor is not None else None

    # -- endpoints ----------------------------------------------------------------------------------------
    def resources_for(self, aliases: list[str]) -> Any:
        """The endpoints of a pipeline that calls ``aliases`` (one manager per configuration, shared by every
        job, so endpoint limits hold across jobs)."""
        if self._resources is not None:
            return self._resources
        if self.settings.resources_file is not None:
            key: tuple[str, ...] = ("file",)
            if key not in self._managers:
                from app.pipeline.resources import ResourceManager

                self._managers[key] = ResourceManager.from_file(self.settings.resources_file)
            return self._managers[key]
        key = ("engine", *sorted(aliases))
        if key not in self._managers:
            if self._backend is not None:
                from app.jobs.embedded.endpoints import BackendResourceManager

                self._managers[key] = BackendResourceManager(sorted(aliases), self._backend)
            else:
                self._managers[key] = self._embedded_manager(sorted(aliases))
        return self._managers[key]

    def _embedded_manager(self, aliases: list[str]) -> Any:
        # the engine extras are optional: import them only when a job needs the in-process engine
        from app.pipeline.resources import ResourceManager
        from app.serving.embedded import embedded_resources, register_embedded_engine

        register_embedded_engine(num_threads=self.settings.num_threads)
        return ResourceManager(embedded_resources(aliases, self.settings.model))
