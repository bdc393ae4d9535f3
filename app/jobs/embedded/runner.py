"""Running one job in this process: trace each open item, pre-load its stored node results, and run the rest
of its graph on a Scheduler whose completion hook checkpoints every node to the database.

Resuming is the same code path: a node whose result is stored is loaded as complete and never runs again, so a
job interrupted by a crash continues where its last committed node left it. Items stream through a bounded
window (traced and submitted as earlier ones finish), so memory does not grow with the size of the job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import ItemStatus, JobStatus, repository, session_scope
from app.db.repository import ItemOutcome
from app.jobs.embedded.events import JobEvents
from app.jobs.embedded.writer import ResultWriter, endpoint_cost
from app.jobs.encoding import decode_item_input, decode_value, error_of, to_jsonable
from app.jobs.graphs import load_module, trace_item
from app.jobs.limits.fairness import FairGate, Share
from app.pipeline.execution.executor import outputs_of
from app.pipeline.execution.scheduler import Scheduler
from app.pipeline.execution.state import ExecutionState, TaskResult
from app.pipeline.profiling import TraceProfiler
from app.pipeline.values import Value

log = logging.getLogger(__name__)

#: the endpoints for a pipeline: given the aliases it calls, a ResourceManager (or a stand-in), or None
ResourcesFor = Callable[[list[str]], Any]

NO_ENDPOINTS_HINT = (
    "set INF_ENGINE_RESOURCES_FILE to a ResourceConfig file that maps them to endpoints (without one, jobs use "
    "the in-process engine, which needs the engine extras and the default model)"
)


@dataclass(frozen=True)
class RunOptions:
    max_concurrent: int = 100
    window: int = 256  # items traced and in flight at once
    page_size: int = 128  # items read from the database per query
    max_attempts: int = 5  # an item whose runs were interrupted this often (a crash loop) fails instead


@dataclass
class _OpenItem:
    id: int
    custom_id: str
    position: int
    input: dict[str, Any]
    graph_hash: str | None
    stored: dict[str, Any]
    attempts: int  # runs started so far, this one included  # node_id → encoded value of the nodes an earlier attempt completed


class JobRun:
    """One job being executed. ``run()`` returns when the job is terminal, or when ``stop()`` interrupts it
    (server shutdown), in which case the job stays ``running`` in the database and is resumed at next start."""

    def __init__(
        self,
        job_id: str,
        sessions: sessionmaker[Session],
        *,
        resources_for: ResourcesFor,
        events: JobEvents,
        options: RunOptions | None = None,
        gate: FairGate | None = None,
    ) -> None:
        self.job_id = job_id

        self.sessions = sessions
        self.resources_for = resources_for
        self.resources: Any = None
        self.events = events
        self.options = options or RunOptions()
        # the items in flight of every job of this executor, shared fairly (app.jobs.limits.fairness)
        self.gate = gate or FairGate(self.options.window)
        self.share = Share(job_id, "anonymous", 0)
        self.profiler = TraceProfiler(include_args=False, process_name=f"job {job_id}")
        self.writer = ResultWriter(sessions, job_id, on_commit=lambda: events.publish(job_id))
        self.scheduler: Scheduler | None = None
        self._futures: set[asyncio.Future[Any]] = set()
        # a job's own cap on its items in flight never keeps it from a slot of the gate that is due to it
        self._slots = asyncio.Semaphore(max(self.options.window, self.gate.capacity))
        self._cancelled = False
        self._stopped = False

    # -- control ------------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """The job was cancelled: stop submitting, cancel what runs; ``run()`` then marks it cancelled."""
        self._cancelled = True
        self._abort()

    def stop(self) -> None:
        """Server shutdown: stop without changing the job's status, so the next start resumes it."""
        self._stopped = True
        self._abort()

    def _abort(self) -> None:
        if self.scheduler is not None:
            for future in list(self._futures):
                self.scheduler.cancel(future)

    def live_trace(self) -> dict[str, Any]:
        return self.profiler.to_chrome_trace()

    # -- the run ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        self.writer.start()
        self.profiler.start()
        try:
            error = await self._execute()
        finally:
            self.profiler.stop()
            await self.writer.close()
        if self._stopped:
            return
        await asyncio.to_thread(self._finish, error)
        self.events.publish(self.job_id)

    async def _execute(self) -> dict[str, Any] | None:
        """Run every open item; a job-level problem (pipeline cannot load, endpoints missing) is returned."""
        try:
            pipeline_name, parameter_state, aliases, self.share = await asyncio.to_thread(self._load_job)
            module = load_module(pipeline_name, parameter_state)
        except Exception as exc:
            return {"type": type(exc).__name__, "message": f"the pipeline cannot be loaded: {exc}"}
        try:
            self.resources = self.resources_for(aliases) if aliases else None
        except Exception as exc:
            return {"type": type(exc).__name__, "message": f"the pipeline's endpoints are not available: {exc}; "
                    + NO_ENDPOINTS_HINT}
        missing = [a for a in aliases if not _has_alias(self.resources, a)]
        if missing:
            return {
                "type": "ConfigurationError",
                "message": f"the pipeline calls the endpoint alias(es) {', '.join(sorted(missing))}, which the "
                           f"server's resources do not define: {NO_ENDPOINTS_HINT}",
            }
        self.writer.cost = partial(endpoint_cost, self.resources)
        self.scheduler = Scheduler(
            resource_manager=self.resources, max_concurrent=self.options.max_concurrent,
            max_task_retries=None, profiler=self.profiler,
        )
        try:
            self.gate.open(self.share)
            await self._submit_all(module)
        finally:
            self.gate.close(self.job_id)
        # wait for the items in flight (after cancel/stop they finish as cancelled at once)
        while self._futures:
            await asyncio.wait(set(self._futures))
        return None

    async def _submit_all(self, module: Any) -> None:
        """Start every open item, page by page, each once the gate gives it a slot."""
        position = -1
        while not (self._cancelled or self._stopped):
            page = await asyncio.to_thread(self._next_page, position)
            if not page:
                break
            for item in page:
                if item.attempts > self.options.max_attempts:
                    self.writer.item_done(ItemOutcome(item.id, ItemStatus.FAILED, None, {
                        "type": "TooManyAttempts",
                        "message": f"the item was started {self.options.max_attempts} times and the server stopped "
                                   "during each run; it is not tried again",
                    }))
                    position = item.position
                    continue
                await self._slots.acquire()
                try:
                    await self.gate.acquire(self.share)  # the fair share of the executor's items in flight
                except BaseException:
                    self._slots.release()
                    raise
                if self._cancelled or self._stopped:
                    self._release()
                    break
                self._submit(module, item)
                position = item.position

    def _submit(self, module: Any, item: _OpenItem) -> None:
        assert self.scheduler is not None
        try:
            args, kwargs = decode_item_input(item.input)
            graph = trace_item(module, args, kwargs)
            preloaded: dict[str, Value] = {}
            if item.stored:
                if item.graph_hash is None or graph.compute_hash() == item.graph_hash:
                    preloaded = {n: decode_value(v) for n, v in item.stored.items() if n in graph.nodes}
                else:
                    log.warning("job %s item %s: the pipeline changed since its nodes were stored; rerunning it",
                                self.job_id, item.custom_id)
            state = ExecutionState(graph, execution_id=f"{self.job_id}:{item.custom_id}", preloaded=preloaded)
        except Exception as exc:
            self.writer.item_done(ItemOutcome(item.id, ItemStatus.FAILED, None, error_of(exc)))
            self._release()
            return
        writer, nodes = self.writer, graph.nodes

        def checkpoint(node_id: str, result: TaskResult) -> None:
            writer.node_done(item.id, nodes[node_id], result)

        future = self.scheduler.submit(state, checkpoint)
        self._futures.add(future)
        future.add_done_callback(lambda f: self._item_finished(item, state, f))

    def _release(self) -> None:
        self._slots.release()
        self.gate.release(self.job_id)

    def _item_finished(self, item: _OpenItem, state: ExecutionState, future: asyncio.Future[Any]) -> None:
        self._futures.discard(future)
        self._release()
        if future.cancelled():
            return  # cancelled or stopped: the item stays open (stop) or is marked cancelled by _finish
        try:
            output = to_jsonable(outputs_of(state))
        except Exception as exc:
            self.writer.item_done(ItemOutcome(item.id, ItemStatus.FAILED, None, error_of(exc)))
        else:
            self.writer.item_done(ItemOutcome(item.id, ItemStatus.COMPLETED, output, None))

    # -- database steps (run in a worker thread) ------------------------------------------------------------
    def _load_job(self) -> tuple[str, dict[str, Any], list[str], Share]:
        with session_scope(self.sessions) as session:
            job = repository.get_job(session, job_id=self.job_id)
            if job is None:
                raise LookupError(f"job {self.job_id} disappeared from the database")
            pipeline = repository.get_pipeline(session, pipeline_id=job.pipeline_id)
            assert pipeline is not None
            aliases = sorted({
                n["config"].get("alias") for n in (pipeline.graph or {}).get("nodes", [])
                if n.get("kind") == "llm" and n.get("config", {}).get("alias")
            })
            share = Share(self.job_id, job.owner, job.priority, job.created_at.timestamp())
            return job.pipeline_name, dict(pipeline.parameter_state or {}), aliases, share

    def _next_page(self, after_position: int) -> list[_OpenItem]:
        with session_scope(self.sessions) as session:
            rows = repository.open_items(session, job_id=self.job_id, after_position=after_position,
                                         limit=self.options.page_size)
            stored = repository.node_values(session, item_ids=[r.id for r in rows])
            repository.start_items(session, item_ids=[r.id for r in rows])
            return [
                _OpenItem(r.id, r.custom_id, r.position, r.input, r.graph_hash, stored.get(r.id, {}), r.attempts + 1)
                for r in rows
            ]

    def _finish(self, error: dict[str, Any] | None) -> None:
        with session_scope(self.sessions) as session:
            repository.save_trace(session, job_id=self.job_id, trace=self.profiler.to_chrome_trace())
            job = repository.get_job(session, job_id=self.job_id)
            assert job is not None
            if self._cancelled or job.status == JobStatus.CANCELLING:
                _close_open_items(session, self.job_id, ItemStatus.CANCELLED,
                                  {"type": "Cancelled", "message": "the job was cancelled before this item finished"})
                repository.finish_job(session, job_id=self.job_id, status=JobStatus.CANCELLED)
            elif error is not None:
                _close_open_items(session, self.job_id, ItemStatus.FAILED, error)
                repository.finish_job(session, job_id=self.job_id, status=JobStatus.FAILED, error=error)
            elif job.total_items and job.completed_items == 0:
                repository.finish_job(session, job_id=self.job_id, status=JobStatus.FAILED, error={
                    "type": "AllItemsFailed",
                    "message": f"all {job.total_items} items failed; each result line has the item's error",
                })
            else:
                repository.finish_job(session, job_id=self.job_id, status=JobStatus.COMPLETED)


def _close_open_items(session: Session, job_id: str, status: ItemStatus, error: dict[str, Any]) -> None:
    repository.close_open_items(session, job_id=job_id, status=status, error=error)


def _has_alias(resources: Any, alias: str) -> bool:
    if resources is None:
        return False
    has_alias = getattr(resources, "has_alias", None)
    return bool(has_alias(alias)) if callable(has_alias) else True  # a scripted fake answers everything


def finish_cancelled(sessions: sessionmaker[Session], job_id: str) -> None:
    """Finish a ``cancelling`` job that no executor is running (it was queued, or its server died)."""
    with session_scope(sessions) as session:
        _close_open_items(session, job_id, ItemStatus.CANCELLED,
                          {"type": "Cancelled", "message": "the job was cancelled before this item finished"})
        repository.finish_job(session, job_id=job_id, status=JobStatus.CANCELLED)
