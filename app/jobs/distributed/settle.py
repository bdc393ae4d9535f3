"""Terminal states on the distributed path: an item whose last node is stored, an item that failed, a job whose
last item finished, a cancelled job whose workers have stopped. Each runs inside the caller's transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from app.db import ItemStatus, JobStatus, repository, utcnow
from app.db.repository import ItemOutcome
from app.db.repository import node_runs as runs_repo
from app.db.repository import node_tasks as tasks_repo
from app.db.repository.node_store import ItemEnd, ItemMetrics, StoredValues
from app.jobs.distributed.nodes import ItemGraph, item_outcome
from app.jobs.distributed.trace import job_trace
from app.jobs.encoding import decode_value
from app.jobs.endpoints import CostFn

ALL_FAILED = "AllItemsFailed"
CANCELLED_ERROR = {"type": "Cancelled", "message": "the job was cancelled before this item finished"}


def finish_item_if_done(session: Session, item: ItemGraph, cost: CostFn | None = None) -> ItemOutcome | None:
    """Store the item's outcome when none of its nodes is left to run; None while some are (or it is closed).

    The item's row is locked first: of two workers storing its last two nodes at once, the second waits and then
    sees the first one's node, so exactly one of them finishes the item.
    """
    ends: list[ItemEnd] = []

    def end(stored: StoredValues) -> ItemEnd:
        ends.append(item_end(item, cost, stored))
        return ends[-1]

    progress = runs_repo.finish_item(session, job_id=item.job_id, item_id=item.item_id, end=end, now=utcnow())
    if progress is None:
        return None
    if progress.finished:
        settle_job(session, item.job_id)
    return ItemOutcome(item.item_id, ends[-1].status, ends[-1].output, ends[-1].error)


def item_end(item: ItemGraph, cost: CostFn | None, stored: StoredValues) -> ItemEnd:
    """The outcome of an item none of whose nodes is left to run (``stored``: its stored values, read when some
    output is not in ``item.values`` yet), with its metrics."""
    if not all(n in item.values or n in item.graph.input_ids for n in item.graph.output_ids):
        item.values.update({n: decode_value(v) for n, v in stored().items() if n in item.graph.nodes})
    outcome = item_outcome(item)
    if outcome is None:
        missing = [n for n in item.graph.output_ids if n not in item.values]
        error = {
            "type": "IncompleteItem",
            "message": f"every node of the item ran but its outputs {missing} were not stored; submit it again",
        }
        return ItemEnd(ItemStatus.FAILED, None, error, item_metrics(item, cost))
    return ItemEnd(outcome.status, outcome.output, outcome.error, item_metrics(item, cost))


def fail_item(session: Session, job_id: str, item_id: int, error: dict[str, Any]) -> bool:
    """The item fails with ``error``; its unfinished nodes will not run. False when it was already terminal."""
    if not tasks_repo.fail_item(session, job_id=job_id, item_id=item_id, error=error):
        return False
    settle_job(session, job_id)
    return True


def settle_job(session: Session, job_id: str, now: datetime | None = None) -> str | None:
    """Make the job terminal when it is due: every item finished (completed, or failed when none completed), or
    cancelling with no node running any more. Returns the job's status afterwards (None: no such job)."""
    job = repository.get_job(session, job_id=job_id)
    if job is None:
        return None
    if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
        finished = job.completed_items + job.failed_items + job.cancelled_items
        if finished < job.total_items:
            return job.status
        if job.total_items and job.completed_items == 0:
            repository.finish_job(
                session,
                job_id=job_id,
                status=JobStatus.FAILED,
                error={
                    "type": ALL_FAILED,
                    "message": f"all {job.total_items} items failed; each result line has the item's error",
                },
            )
            _save_trace(session, job_id)
            return JobStatus.FAILED
        repository.finish_job(session, job_id=job_id, status=JobStatus.COMPLETED)
        _save_trace(session, job_id)
        return JobStatus.COMPLETED
    if job.status == JobStatus.CANCELLING:
        if tasks_repo.live_node_tasks(session, job_id=job_id, now=now or utcnow()):
            return job.status  # workers still run some nodes; the sweeper looks again
        tasks_repo.close_job_node_tasks(session, job_id=job_id)
        repository.close_open_items(session, job_id=job_id, status=ItemStatus.CANCELLED, error=CANCELLED_ERROR)
        repository.finish_job(session, job_id=job_id, status=JobStatus.CANCELLED)
        _save_trace(session, job_id)
        return JobStatus.CANCELLED
    return job.status


def _save_trace(session: Session, job_id: str) -> None:
    """The finished job's Chrome trace, from its node rows (``GET /v1/jobs/{id}/trace``)."""
    repository.save_trace(session, job_id=job_id, trace=job_trace(session, job_id))


def item_metrics(item: ItemGraph, cost: CostFn | None) -> ItemMetrics:
    """The item's LLM calls, tokens, cost and latency (from the stored values' metadata), counted once when the
    item finishes."""
    calls = tokens_in = tokens_out = 0
    latency_total = latency_max = dollars = 0.0
    for node_id, node in item.graph.nodes.items():
        value = item.values.get(node_id)
        if node.kind != "llm" or value is None or not value.meta or "input_tokens" not in value.meta:
            continue
        meta = value.meta
        n_in, n_out = int(meta.get("input_tokens") or 0), int(meta.get("output_tokens") or 0)
        latency = float(meta.get("latency_ms") or 0.0)
        calls += 1
        tokens_in += n_in
        tokens_out += n_out
        latency_total += latency
        latency_max = max(latency_max, latency)
        if cost is not None and node.alias is not None:
            dollars += cost(node.alias, meta.get("model"), n_in, n_out)
    return ItemMetrics(calls, tokens_in, tokens_out, dollars, latency_total, latency_max)
