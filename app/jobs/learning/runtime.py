"""Running trainings and evaluations: the server's background executor, and the one-shot runner of a Celery
worker (scheduled evaluations).

A run is claimed with a conditional UPDATE (queued → running), so two runners never run it together; its runner
renews a heartbeat every third of ``lease_s`` and watches for a cancel request. A run whose heartbeat is older
than the lease lost its runner (the process died): the next runner takes it over (attempts + 1). An evaluation
then simply runs again; a training fails as interrupted (train() keeps its state in memory). After
``max_attempts`` a run is failed instead of retried forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.aio import wait_event
from app.db import session_scope, utcnow
from app.db.optimization_models import Evaluation, RunStatus, Training
from app.db.repository import runs
from app.jobs.endpoints import EndpointResolver
from app.jobs.learning.evaluations import EvaluationRun
from app.jobs.learning.training import TrainingRun

log = logging.getLogger(__name__)

ResourcesFor = Callable[[list[str]], Any]
KINDS: dict[str, tuple[type[Any], type[Any]]] = {
    "training": (Training, TrainingRun),
    "evaluation": (Evaluation, EvaluationRun),
}


async def supervise(
    run: Any, sessions: sessionmaker[Session], model: type[Any], lease_s: float, check_every: float = 1.0
) -> None:
    """Run ``run.run()`` while renewing its heartbeat and cancelling it when a cancel is requested (both checked
    every ``check_every`` seconds, at least three times per lease)."""
    task = asyncio.ensure_future(run.run())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=min(check_every, lease_s / 3))
            if done:
                break
            status = await asyncio.to_thread(_beat, sessions, model, run.id)
            if status == RunStatus.CANCELLING:
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        if not task.done():  # we were cancelled (shutdown): stop the run, leaving its status for a takeover
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _beat(sessions: sessionmaker[Session], model: type[Any], run_id: str) -> str | None:
    with session_scope(sessions) as session:
        runs.beat(session, model, run_ids=[run_id])
        row = runs.get_run(session, model, run_id=run_id)
        return row.status if row is not None else None


def claim(sessions: sessionmaker[Session], model: type[Any], run_id: str, lease_s: float) -> bool:
    with session_scope(sessions) as session:
        return runs.claim_run(session, model, run_id=run_id, stale_before=utcnow() - timedelta(seconds=lease_s))


def run_evaluation_once(
    sessions: sessionmaker[Session], evaluation_id: str, *, settings: Any, lease_s: float = 60.0
) -> bool:
    """Claim and run one evaluation to its end in this thread (a Celery task's body). False when another
    runner has it or it is finished: a re-delivered task does nothing. The endpoints (``settings``' resources
    file behind the global limits, else the in-process engine) live for this run only: their clients belong to this run's event loop."""
    if not claim(sessions, Evaluation, evaluation_id, lease_s):
        return False
    async def run() -> None:
        # the same resolution as every node-running process: global limits in Redis when it is configured
        endpoints = EndpointResolver(settings)
        try:
            evaluation = EvaluationRun(evaluation_id, sessions, resources_for=endpoints)
            await supervise(evaluation, sessions, Evaluation, lease_s)
        finally:
            await endpoints.aclose()

    asyncio.run(run())
    return True


class LearningExecutor:
    """Claims queued (or abandoned) trainings and evaluations and runs up to ``max_running`` of each kind."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        resources_for: ResourcesFor,
        max_running: int = 2,
        poll_interval: float = 1.0,
        lease_s: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        self.sessions = sessions
        self.resources_for = resources_for
        self.max_running = max_running
        self.poll_interval = poll_interval
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._kind_of: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name="learning-executor")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop every run without changing its status; a later runner takes it over once the lease expires."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # the database may be briefly unavailable: try again on the next tick
                log.exception("the learning executor's tick failed; retrying")
            await wait_event(self._wake, self.poll_interval)
            self._wake.clear()

    async def _tick(self) -> None:
        await asyncio.to_thread(self._fail_exhausted)
        for kind, (model, run_class) in KINDS.items():
            running = sum(1 for k in self._kind_of.values() if k == kind)
            while running < self.max_running:
                run_id = await asyncio.to_thread(self._claim_next, model)
                if run_id is None:
                    break
                run = run_class(run_id, self.sessions, resources_for=self.resources_for)
                self._launch(kind, run, model)
                running += 1

    def _launch(self, kind: str, run: Any, model: type[Any]) -> None:
        task = asyncio.get_running_loop().create_task(
            supervise(run, self.sessions, model, self.lease_s, self.poll_interval), name=f"{kind}-{run.id}"
        )
        self.tasks[run.id] = task
        self._kind_of[run.id] = kind

        def done(_: asyncio.Task[None]) -> None:
            self.tasks.pop(run.id, None)
            self._kind_of.pop(run.id, None)
            self._wake.set()  # a slot is free

        task.add_done_callback(done)

    # -- database steps (worker threads) ------------------------------------------------------------------------
    def _stale_before(self) -> Any:
        return utcnow() - timedelta(seconds=self.lease_s)

    def _claim_next(self, model: type[Any]) -> str | None:
        with session_scope(self.sessions) as session:
            stale = self._stale_before()
            for run_id in runs.claimable_ids(session, model, stale_before=stale, max_attempts=self.max_attempts):
                if run_id in self.tasks:
                    continue
                if runs.claim_run(session, model, run_id=run_id, stale_before=stale):
                    return run_id
        return None

    def _fail_exhausted(self) -> None:
        with session_scope(self.sessions) as session:
            models: tuple[type[Any], ...] = (Training, Evaluation)
            for model in models:
                for run_id in runs.exhausted_ids(session, model, stale_before=self._stale_before(),
                                                 max_attempts=self.max_attempts):
                    runs.finish_run(session, model, run_id=run_id, status=RunStatus.FAILED, error={
                        "type": "TooManyAttempts",
                        "message": f"the process running it stopped {self.max_attempts} times; it is not tried again",
                    })


class LearningRuntime:
    """The server's trainings and evaluations, on the jobs runtime's database and endpoints: the executor starts
    with the first request (or at boot when there is a database with runs to pick up)."""

    def __init__(self, jobs: Any, *, lease_s: float = 60.0) -> None:
        self.jobs = jobs
        self.lease_s = lease_s
        self.executor: LearningExecutor | None = None
        self._lock = asyncio.Lock()
        self._stopped = False

    @property
    def limits(self) -> Any:
        return self.jobs.limits

    def session(self) -> Any:
        return self.jobs.session()

    async def start_if_configured(self) -> None:
        if not self.jobs.has_state():
            return
        try:
            await self.ensure_started()
        except Exception as exc:
            log.error("trainings and evaluations are unavailable until the database is reachable (%s: %s)",
                      type(exc).__name__, exc)

    async def ensure_started(self) -> None:
        await self.jobs.ensure_started()
        # a server started to serve the API only (another process runs jobs) does not run these either
        if self.executor is not None or self._stopped or not getattr(self.jobs, "_run_executor", True):
            return
        async with self._lock:
            if self.executor is None and not self._stopped:
                settings = self.jobs.settings
                executor = LearningExecutor(
                    self.jobs.sessions, resources_for=self.jobs.resources_for,
                    max_running=settings.jobs_max_running, poll_interval=settings.jobs_poll_interval,
                    lease_s=self.lease_s,
                )
                await executor.start()
                self.executor = executor

    def wake(self) -> None:
        if self.executor is not None:
            self.executor.wake()

    async def stop(self) -> None:
        self._stopped = True
        if self.executor is not None:
            await self.executor.stop()
            self.executor = None
