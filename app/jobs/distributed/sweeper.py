"""The sweeper: what a periodic task (Celery beat, one instance) does so that no node is lost.

* A running node whose lease ran out (its worker died: SIGKILL, OOM, a lost machine) is queued again with the
  next attempt number, or fails its item once it was started ``max_attempts`` times.
* A queued node whose message was sent and should have been taken long ago while its queue is empty (the message
  was lost: a crash between commit and send, a broker that lost its data) is sent again.
* The dispatch windows are refilled (the workers refill them as nodes end; this catches up after a lull).
* Jobs whose dispatch never ran or stopped half-way (the API died) are dispatched.
* An item whose nodes are all stored but whose outcome is not (its worker stopped in between) is finished.
* Jobs past their completion window (``expires_at``) are cancelled with an ``Expired`` error, and cancelling
  jobs whose workers have stopped are finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import ITEM_OPEN, JobStatus, repository, session_scope, utcnow
from app.db.models import NodeTask, NodeTaskStatus
from app.db.repository import node_tasks as tasks_repo
from app.jobs.distributed.dispatch import dispatch_job
from app.jobs.distributed.messages import Dispatcher, Endpoints, NodeMessage
from app.jobs.distributed.node_task import NodePolicy, message_of
from app.jobs.distributed.nodes import load_item_graph
from app.jobs.distributed.settle import fail_item, finish_item_if_done, settle_job
from app.jobs.distributed.window import DispatchWindow
from app.jobs.endpoints import endpoint_cost
from app.jobs.graphs import load_module

log = logging.getLogger(__name__)

OPEN = (JobStatus.QUEUED, JobStatus.RUNNING)
EXPIRED_ERROR = {"type": "Expired", "message": "the job's completion window ended before it finished"}


@dataclass
class SweepReport:
    requeued: int = 0  # running nodes whose lease ran out, queued again
    resent: int = 0  # queued nodes whose message was lost, sent again
    failed: int = 0  # items failed because a node ran out of attempts
    dispatched: int = 0  # node tasks of jobs whose dispatch had not finished
    expired: int = 0  # jobs past their window, cancelled
    settled: int = 0  # cancelling jobs finished
    finished: int = 0  # items whose nodes were all stored but whose outcome was not (their worker stopped)
    refilled: int = 0  # ready nodes sent to fill the dispatch windows


def sweep(
    sessions: sessionmaker[Session],
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    policy: NodePolicy | None = None,
    *,
    now: datetime | None = None,
    limit: int = 1000,
    resources_for: Callable[[list[str]], Any] | None = None,
    window: DispatchWindow | None = None,
) -> SweepReport:
    """One sweep (see the module docstring); ``resources_for`` prices the LLM calls of items it finishes;
    ``window``: the process's dispatch windows (default: fixed windows without quotas)."""
    policy = policy or NodePolicy()
    now = now or utcnow()
    report = SweepReport()
    with session_scope(sessions) as session:
        report.expired = _expire(session, now)
        report.settled = _settle_cancelling(session, now)
    messages = _lost_leases(sessions, policy, now, limit, report)
    messages += _lost_messages(sessions, dispatcher, policy, now, limit, report)
    if messages:
        dispatcher.send(messages)
    with session_scope(sessions) as session:
        report.finished = _finish_done_items(session, resources_for)
    stale = now - timedelta(seconds=policy.stale_s)
    with session_scope(sessions) as session:
        undispatched = tasks_repo.queued_jobs_older_than(session, before=stale)
        undispatched += tasks_repo.running_jobs_started_before(session, before=stale)
    for job_id in undispatched:
        report.dispatched += dispatch_job(sessions, job_id, dispatcher, endpoints, policy, window=window)
    if window is None:
        window = DispatchWindow.fixed(sessions, dispatcher, policy.stale_s)
    report.refilled = max(0, window.refill())
    if any(vars(report).values()):
        log.info("sweep: %s", report)
    return report


def _finish_done_items(session: Session, resources_for: Callable[[list[str]], Any] | None) -> int:
    finished = 0
    modules: dict[str, Any] = {}
    for item_id, job_id in tasks_repo.items_with_every_node_done(session):
        if job_id not in modules:
            job = repository.get_job(session, job_id=job_id)
            pipeline = repository.get_pipeline(session, pipeline_id=job.pipeline_id) if job else None
            if job is None or pipeline is None:
                continue
            modules[job_id] = load_module(job.pipeline_name, dict(pipeline.parameter_state or {}))
        item = load_item_graph(session, item_id=item_id, module=modules[job_id])
        aliases = sorted({n.alias for n in item.graph.nodes.values() if n.kind == "llm" and n.alias})
        cost = (
            partial(endpoint_cost, resources_for(aliases)) if aliases and resources_for is not None else None
        )
        if finish_item_if_done(session, item, cost) is not None:
            finished += 1
    return finished


def _expire(session: Session, now: datetime) -> int:
    expired = 0
    for job_id in tasks_repo.jobs_past_window(session, now=now, statuses=OPEN):
        batch = tasks_repo.batch_of_job(session, job_id=job_id)
        if batch is not None:  # an OpenAI batch ends "expired", not "cancelled"
            repository.mark_batch_expired(session, batch=batch, at=now)
        if repository.request_cancel(session, job_id=job_id):
            repository.set_job_error(session, job_id=job_id, error=EXPIRED_ERROR)
            expired += 1
    return expired


def _settle_cancelling(session: Session, now: datetime) -> int:
    settled = 0
    for job in repository.jobs_with_status(session, statuses=[JobStatus.CANCELLING]):
        if settle_job(session, job.id, now) == JobStatus.CANCELLED:
            settled += 1
    return settled


def _lost_leases(
    sessions: sessionmaker[Session], policy: NodePolicy, now: datetime, limit: int, report: SweepReport
) -> list[NodeMessage]:
    messages: list[NodeMessage] = []
    with session_scope(sessions) as session:
        for row in tasks_repo.overdue_node_tasks(
            session, status=NodeTaskStatus.RUNNING, now=now, limit=limit
        ):
            if not _still_open(session, row):
                continue
            if row.attempts >= policy.max_attempts:
                if fail_item(
                    session,
                    row.job_id,
                    row.item_id,
                    {
                        "type": "TooManyAttempts",
                        "message": f"node {row.node_id} was started {row.attempts} times and its worker stopped each "
                        "time; raise INF_ENGINE_NODE_MAX_ATTEMPTS to allow more",
                    },
                ):
                    report.failed += 1
                continue
            ref = tasks_repo.requeue_node_task(
                session,
                row_id=row.id,
                expect_status=NodeTaskStatus.RUNNING,
                deadline=now + timedelta(seconds=policy.stale_s),
                overdue_at=now,
            )
            if ref is not None:
                messages.append(message_of(ref))
                report.requeued += 1
    return messages


def _lost_messages(
    sessions: sessionmaker[Session],
    dispatcher: Dispatcher,
    policy: NodePolicy,
    now: datetime,
    limit: int,
    report: SweepReport,
) -> list[NodeMessage]:
    """Queued nodes past their deadline, in queues that are empty: their messages cannot be waiting anywhere."""
    messages: list[NodeMessage] = []
    empty: dict[str, bool] = {}
    with session_scope(sessions) as session:
        for row in tasks_repo.overdue_node_tasks(session, status=NodeTaskStatus.QUEUED, now=now, limit=limit):
            if not _still_open(session, row):
                continue
            if row.queue not in empty:
                empty[row.queue] = dispatcher.queue_depth(row.queue) == 0
            long_overdue = row.deadline is not None and _aware(row.deadline) < now - timedelta(
                seconds=policy.resend_after_s
            )
            if not empty[row.queue] and not long_overdue:
                continue  # a backlog: the message may still be in it (past resend_after_s, send it anyway)
            ref = tasks_repo.requeue_node_task(
                session,
                row_id=row.id,
                expect_status=NodeTaskStatus.QUEUED,
                deadline=now + timedelta(seconds=policy.stale_s),
                overdue_at=now,
            )
            if ref is not None:
                messages.append(message_of(ref))
                report.resent += 1
    return messages


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)  # SQLite hands back naive UTC


def _still_open(session: Session, row: NodeTask) -> bool:
    """False (and the node closed) when its job or item has ended."""
    job = repository.get_job(session, job_id=row.job_id)
    item = repository.get_item_by_id(session, item_id=row.item_id)
    if job is not None and job.status in OPEN and item is not None and item.status in ITEM_OPEN:
        return True
    tasks_repo.set_node_task_status(
        session, item_id=row.item_id, node_ids=[row.node_id], status=NodeTaskStatus.FAILED
    )
    return False
