"""Group commit of node results, item outcomes and metrics for one running job.

Completed nodes are queued by the scheduler's hook (on the event loop) and written by one writer task, each
batch in one transaction in a worker thread: a node result is in the database milliseconds after the node
finished, and a thousand nodes finishing together cost one commit, not a thousand. Node rows are written before
(or with) the outcome of their item, so a stored outcome always has its checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from app.db import ItemStatus, repository, session_scope
from app.db.repository import ItemOutcome
from app.jobs.encoding import encode_value
from app.pipeline.execution.state import TaskResult
from app.pipeline.graph import GraphNode

log = logging.getLogger(__name__)

#: dollars for (alias, model, input tokens, output tokens)
CostFn = Callable[[str, str | None, int, int], float]


@dataclass
class _Metrics:
    llm_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    latency_ms_total: float = 0.0
    latency_ms_max: float = 0.0

    def empty(self) -> bool:
        return self.llm_calls == 0


@dataclass
class _Batch:
    nodes: list[dict[str, Any]] = field(default_factory=list)
    items: list[ItemOutcome] = field(default_factory=list)
    metrics: _Metrics = field(default_factory=_Metrics)

    def empty(self) -> bool:
        return not self.nodes and not self.items and self.metrics.empty()


class ResultWriter:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        *,
        on_commit: Callable[[], None] | None = None,
        cost: CostFn | None = None,
        retry_delay: float = 0.5,
        coalesce_seconds: float = 0.005,
    ) -> None:
        self.sessions = sessions
        self.job_id = job_id
        self.on_commit = on_commit
        self.cost = cost
        self.retry_delay = retry_delay
        self.coalesce_seconds = coalesce_seconds
        self._batch = _Batch()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.nodes_written = 0
        self.items_written = 0

    # -- producers (called on the loop, never block) -------------------------------------------------------
    def node_done(self, item_id: int, node: GraphNode, result: TaskResult) -> None:
        try:
            value = encode_value(result.value)
        except ValueError as exc:  # a payload the JSON encoding does not know: keep the run going, skip the row
            log.warning("job %s: node %s of item %s is not storable (%s); it would run again on resume",
                        self.job_id, node.id, item_id, exc)
            return
        self._batch.nodes.append(
            {"job_id": self.job_id, "item_id": item_id, "node_id": node.id, "value": value,
             "duration_ms": round(result.duration_ms, 3), "attempt": result.retry_count}
        )
        if node.kind == "llm":
            self._count_llm(node, result)
        self._wake.set()

    def _count_llm(self, node: GraphNode, result: TaskResult) -> None:
        meta = result.value.meta or {}
        m = self._batch.metrics
        tokens_in, tokens_out = int(meta.get("input_tokens") or 0), int(meta.get("output_tokens") or 0)
        latency = float(meta.get("latency_ms") or result.duration_ms)
        m.llm_calls += 1
        m.input_tokens += tokens_in
        m.output_tokens += tokens_out
        m.latency_ms_total += latency
        m.latency_ms_max = max(m.latency_ms_max, latency)
        if self.cost is not None and node.alias is not None:
            m.cost += self.cost(node.alias, meta.get("model"), tokens_in, tokens_out)

    def item_done(self, outcome: ItemOutcome) -> None:
        self._batch.items.append(outcome)
        self._wake.set()

    # -- the writer task ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"writer-{self.job_id}")

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            # a few milliseconds of coalescing turn a burst of finishing nodes into one transaction
            await asyncio.sleep(self.coalesce_seconds)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write everything queued so far (returns once it is committed)."""
        async with self._lock:
            while not self._batch.empty():
                batch, self._batch = self._batch, _Batch()
                await self._write_with_retries(batch)
                self.nodes_written += len(batch.nodes)
                self.items_written += len(batch.items)
                if self.on_commit is not None:
                    self.on_commit()

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _write_with_retries(self, batch: _Batch) -> None:
        delay = self.retry_delay
        while True:
            try:
                await asyncio.to_thread(self._write, batch)
                return
            except DBAPIError as exc:
                if not exc.connection_invalidated and not _is_connection_error(exc):
                    log.exception("job %s: a batch of results could not be stored; storing the items as failed",
                                  self.job_id)
                    batch = _Batch(items=[_storage_failure(o, exc) for o in batch.items])
                    if batch.empty():
                        return
                    continue
                # the database went away (restart, failover): keep the batch and try again
                log.warning("job %s: database unavailable (%s); retrying in %.1fs", self.job_id, exc.orig, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _write(self, batch: _Batch) -> None:
        with session_scope(self.sessions) as session:
            repository.insert_node_results(session, rows=batch.nodes)
            if not batch.metrics.empty():
                m = batch.metrics
                repository.add_job_metrics(
                    session, job_id=self.job_id, llm_calls=m.llm_calls, input_tokens=m.input_tokens,
                    output_tokens=m.output_tokens, cost=m.cost, latency_ms_total=m.latency_ms_total,
                    latency_ms_max=m.latency_ms_max,
                )
            repository.finish_items(session, job_id=self.job_id, outcomes=batch.items)


def endpoint_cost(resources: Any, alias: str, model: str | None, tokens_in: int, tokens_out: int) -> float:
    """Dollars for one call from the endpoint's per-1M token prices (0 when the resources do not say)."""
    endpoints = getattr(resources, "endpoints", None)
    if not callable(endpoints):
        return 0.0
    try:
        configs = list(endpoints(alias))
    except Exception:
        return 0.0
    config = next((c for c in configs if getattr(c, "model", None) == model), configs[0] if configs else None)
    if config is None:
        return 0.0
    prices = (getattr(config, "input_cost_per_1m", 0.0), getattr(config, "output_cost_per_1m", 0.0))
    return float(tokens_in * prices[0] + tokens_out * prices[1]) / 1_000_000


def _is_connection_error(exc: DBAPIError) -> bool:
    from sqlalchemy.exc import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)


def _storage_failure(outcome: ItemOutcome, exc: Exception) -> ItemOutcome:
    message = f"the item's result could not be stored: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return ItemOutcome(outcome.item_id, ItemStatus.FAILED, None, {"type": "StorageError", "message": message})
