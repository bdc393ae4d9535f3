"""The queries of the fair, bounded dispatcher (``app.jobs.distributed.window``): what is in flight on each queue,
which jobs compete, and taking a job's next unsent ready nodes. The partial indexes ``ix_node_tasks_unsent``
and ``ix_node_tasks_in_flight`` serve them; their predicates are repeated here word for word so the planner
matches them."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Table, bindparam, func, or_, select, text, update
from sqlalchemy.orm import Session

from app.db.models import IN_FLIGHT_SQL, UNSENT_SQL, Job, JobStatus, NodeTask
from app.db.repository.node_tasks import NodeTaskRef

#: the advisory lock that serialises refills of the dispatch windows (one refill at a time counts and sends)
DISPATCH_LOCK = zlib.crc32(b"inf-engine:dispatch-window")


@dataclass(frozen=True, slots=True)
class OpenJob:
    id: str
    tenant: str
    priority: int
    created_at: datetime


def try_lock_dispatch(session: Session) -> bool:
    """Take the dispatch lock until the transaction ends; False when another refill holds it (PostgreSQL). On
    SQLite the database's single writer already serialises refills."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.execute(select(func.pg_try_advisory_xact_lock(DISPATCH_LOCK))).scalar())


def open_jobs(session: Session) -> list[OpenJob]:
    """Jobs whose nodes may be dispatched (queued or running), most urgent first."""
    stmt = (
        select(Job.id, Job.owner, Job.priority, Job.created_at)
        .where(Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
        .order_by(Job.priority, Job.created_at)
    )
    return [OpenJob(r[0], r[1], int(r[2]), r[3]) for r in session.execute(stmt)]


def in_flight(session: Session) -> dict[tuple[str, str, str], int]:
    """``{(queue, job_id, status): n}``: node tasks sent and not claimed yet (``queued``), or ``running``."""
    stmt = (
        select(NodeTask.queue, NodeTask.job_id, NodeTask.status, func.count())
        .where(text(IN_FLIGHT_SQL))
        .group_by(NodeTask.queue, NodeTask.job_id, NodeTask.status)
    )
    return {(q, j, s): int(n) for q, j, s, n in session.execute(stmt)}


_NT: Table = NodeTask.__table__  # type: ignore[assignment]
# Core with bind parameters, built once: a refill runs it per job and queue many times a second, and the ORM's
# bulk update would rebuild and recompile it each time
_PICK = (
    select(_NT.c.id)
    .where(
        text(UNSENT_SQL),
        _NT.c.job_id == bindparam("t_job"),
        _NT.c.queue == bindparam("t_queue"),
        or_(_NT.c.deadline.is_(None), _NT.c.deadline <= bindparam("t_now")),
    )
    .order_by(_NT.c.priority, _NT.c.item_id)
    .limit(bindparam("t_limit"))
    .with_for_update(skip_locked=True)
)
_TAKE_UNSENT = (
    update(_NT)
    .where(_NT.c.id.in_(_PICK.scalar_subquery()))
    .values(sent_at=bindparam("t_now"), deadline=bindparam("t_deadline"), updated_at=bindparam("t_now"))
    .returning(_NT.c.job_id, _NT.c.item_id, _NT.c.node_id, _NT.c.attempts, _NT.c.queue, _NT.c.priority)
)


def take_unsent(
    session: Session, *, job_id: str, queue: str, limit: int, now: datetime, deadline: datetime
) -> list[NodeTaskRef]:
    """Mark up to ``limit`` of the job's unsent ready nodes on ``queue`` as sent (most urgent node priority first,
    then input order; a retry's backoff not yet over is skipped) and return them, to send after the commit.
    Rows another refill holds are skipped, never waited for."""
    if limit <= 0:
        return []
    params = {"t_job": job_id, "t_queue": queue, "t_now": now, "t_limit": limit, "t_deadline": deadline}
    rows = session.connection().execute(_TAKE_UNSENT, params)
    refs = [NodeTaskRef(r[0], int(r[1]), r[2], int(r[3]), r[4], int(r[5])) for r in rows]
    return sorted(refs, key=lambda r: (r.priority, r.item_id, r.node_id))  # RETURNING keeps no order
