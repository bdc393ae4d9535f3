"""Node tasks: the dispatch state of each node of each item on the distributed path (Celery workers).

The counters change only in single statements (``UPDATE ... RETURNING``), so concurrent workers finishing two
dependencies of one node cannot both see it become ready, and a re-delivered task cannot count twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, exists, func, select, text, true, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import (
    IN_FLIGHT_SQL,
    ITEM_OPEN,
    Batch,
    Item,
    ItemStatus,
    Job,
    JobStatus,
    NodeTask,
    NodeTaskStatus,
)
from app.db.repository._dialect import insert_ignoring_conflicts
from app.db.repository.items import ItemOutcome, finish_items


@dataclass(frozen=True, slots=True)
class NodeTaskRef:
    """What it takes to send one node's task: ids, the attempt count, and its queue and priority."""

    job_id: str
    item_id: int
    node_id: str
    attempts: int
    queue: str
    priority: int


_REF_COLUMNS = (
    NodeTask.job_id,
    NodeTask.item_id,
    NodeTask.node_id,
    NodeTask.attempts,
    NodeTask.queue,
    NodeTask.priority,
)


def _refs(rows: Any) -> list[NodeTaskRef]:
    return [NodeTaskRef(r[0], int(r[1]), r[2], int(r[3]), r[4], int(r[5])) for r in rows]


def add_node_tasks(session: Session, *, rows: Sequence[dict[str, Any]]) -> list[NodeTaskRef]:
    """Insert node tasks (job_id, item_id, node_id, kind, status, waiting, queue, priority, deadline), skipping
    nodes that have a row already; returns the inserted rows that are ``queued`` (the tasks to send)."""
    if not rows:
        return []
    now = utcnow()
    if session.get_bind().dialect.name == "postgresql":
        inserted = _add_node_tasks_pg(session, rows, now)
    else:
        payload = [{"attempts": 0, "updated_at": now, **row} for row in rows]
        table = NodeTask.__table__
        stmt = insert_ignoring_conflicts(session, table, ["item_id", "node_id"]).returning(
            *(table.c[c.key] for c in _REF_COLUMNS), table.c.status
        )
        # Core, not the ORM's bulk insert: the ORM matches returned rows to parameter sets, which it cannot do
        # when ON CONFLICT skips some, and falls back to one statement per row; Core sends them in batches
        inserted = list(session.connection().execute(stmt, payload).all())
    return _refs(r for r in inserted if r[6] == NodeTaskStatus.QUEUED)


# One statement of constant text for any number of rows (arrays, not a VALUES list as long as the page): the
# driver prepares it once, where a page-sized VALUES list is parsed and planned anew for every page
_ADD_NODE_TASKS_PG = """
    INSERT INTO node_tasks (job_id, item_id, node_id, kind, status, waiting, queue, priority, deadline, attempts,
                            updated_at)
    SELECT r.job_id, r.item_id, r.node_id, r.kind, r.status, r.waiting, r.queue, r.priority, r.deadline, 0,
           %(now)s
    FROM unnest(CAST(%(jobs)s AS varchar[]), CAST(%(items)s AS bigint[]), CAST(%(nodes)s AS varchar[]),
                CAST(%(kinds)s AS varchar[]), CAST(%(statuses)s AS varchar[]), CAST(%(waiting)s AS integer[]),
                CAST(%(queues)s AS varchar[]), CAST(%(priorities)s AS integer[]),
                CAST(%(deadlines)s AS timestamptz[]))
         AS r(job_id, item_id, node_id, kind, status, waiting, queue, priority, deadline)
    ON CONFLICT (item_id, node_id) DO NOTHING
    RETURNING job_id, item_id, node_id, attempts, queue, priority, status
"""


def _add_node_tasks_pg(session: Session, rows: Sequence[dict[str, Any]], now: datetime) -> list[Any]:
    params = {
        "now": now,
        "jobs": [r["job_id"] for r in rows],
        "items": [r["item_id"] for r in rows],
        "nodes": [r["node_id"] for r in rows],
        "kinds": [r["kind"] for r in rows],
        "statuses": [str(r["status"]) for r in rows],
        "waiting": [r["waiting"] for r in rows],
        "queues": [r["queue"] for r in rows],
        "priorities": [r["priority"] for r in rows],
        "deadlines": [r.get("deadline") for r in rows],
    }
    return list(session.connection().exec_driver_sql(_ADD_NODE_TASKS_PG, params).all())


def lock_node_task(session: Session, *, item_id: int, node_id: str) -> NodeTask | None:
    """The node's row, locked until the transaction ends (claims of one node are serialised)."""
    stmt = select(NodeTask).where(NodeTask.item_id == item_id, NodeTask.node_id == node_id).with_for_update()
    return session.scalars(stmt).one_or_none()


def renew_node_lease(session: Session, *, item_id: int, node_id: str, token: str, deadline: datetime) -> bool:
    """Push the running delivery's lease to ``deadline``; False when the node is no longer its (taken over)."""
    result = session.execute(
        update(NodeTask)
        .where(
            NodeTask.item_id == item_id,
            NodeTask.node_id == node_id,
            NodeTask.claimed_by == token,
            NodeTask.status == NodeTaskStatus.RUNNING,
        )
        .values(deadline=deadline, updated_at=utcnow())
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def set_node_task_status(
    session: Session,
    *,
    item_id: int,
    node_ids: Sequence[str],
    status: NodeTaskStatus,
    deadline: datetime | None = None,
) -> None:
    """Move nodes to ``status`` (done and failed clear the lease; queued takes the new ``deadline``). A stored
    node stays done: a caller that read it earlier as unfinished cannot fail it afterwards."""
    if not node_ids:
        return
    now = utcnow()
    values: dict[str, Any] = {"status": status, "updated_at": now, "deadline": deadline}
    if status in (NodeTaskStatus.DONE, NodeTaskStatus.FAILED):
        values["finished_at"] = now
    if status == NodeTaskStatus.QUEUED:
        values["claimed_by"] = None
    stmt = update(NodeTask).where(NodeTask.item_id == item_id, NodeTask.node_id.in_(list(node_ids)))
    if status != NodeTaskStatus.DONE:
        stmt = stmt.where(NodeTask.status != NodeTaskStatus.DONE)
    session.execute(stmt.values(**values))


def release_dependents(
    session: Session, *, item_id: int, node_ids: Sequence[str], deadline: datetime
) -> list[NodeTaskRef]:
    """One dependency of each of ``node_ids`` is stored: count it down; the nodes whose last dependency it was
    become ``queued`` in the same statement and are returned (each exactly once, whoever counts last)."""
    if not node_ids:
        return []
    remaining = NodeTask.waiting - 1
    stmt = (
        update(NodeTask)
        .where(
            NodeTask.item_id == item_id,
            NodeTask.node_id.in_(list(node_ids)),
            NodeTask.status == NodeTaskStatus.WAITING,
        )
        .values(
            waiting=remaining,
            status=case((remaining <= 0, NodeTaskStatus.QUEUED.value), else_=NodeTask.status),
            deadline=case((remaining <= 0, deadline), else_=NodeTask.deadline),
            updated_at=utcnow(),
        )
        .returning(*_REF_COLUMNS, NodeTask.status)
    )
    return _refs(r for r in session.execute(stmt).all() if r[6] == NodeTaskStatus.QUEUED)


def fail_open_node_tasks(session: Session, *, item_id: int) -> None:
    """The item is terminal: none of its unfinished nodes will run."""
    now = utcnow()
    session.execute(
        update(NodeTask)
        .where(
            NodeTask.item_id == item_id,
            NodeTask.status.in_([NodeTaskStatus.WAITING, NodeTaskStatus.QUEUED, NodeTaskStatus.RUNNING]),
        )
        .values(status=NodeTaskStatus.FAILED, deadline=None, finished_at=now, updated_at=now)
    )


def overdue_node_tasks(
    session: Session, *, status: NodeTaskStatus, now: datetime, limit: int = 500
) -> list[NodeTask]:
    """Running nodes whose lease ran out, or queued nodes whose message was sent and should have been taken by
    now (a queued node not sent yet waits for its dispatch window, not for the sweeper)."""
    stmt = (
        select(NodeTask)
        .where(NodeTask.status == status, NodeTask.deadline < now)
        .where(NodeTask.sent_at.is_not(None) if status == NodeTaskStatus.QUEUED else true())
        .order_by(NodeTask.deadline)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def requeue_node_task(
    session: Session,
    *,
    row_id: int,
    expect_status: NodeTaskStatus,
    deadline: datetime,
    overdue_at: datetime | None = None,
) -> NodeTaskRef | None:
    """Queue the node again (the sweeper: its worker vanished or its message was lost; a worker: a transient
    failure); None when the row moved on meanwhile (claimed, finished, or re-queued by a concurrent sweep, which
    the ``overdue_at`` condition, re-checked on the locked row, catches). The caller sends its message at once
    (a retry's with a countdown), so it counts as sent: it replaces a node that was in flight."""
    now = utcnow()
    stmt = update(NodeTask).where(NodeTask.id == row_id, NodeTask.status == expect_status)
    if overdue_at is not None:
        stmt = stmt.where(NodeTask.deadline < overdue_at)
    row = session.execute(
        stmt.values(
            status=NodeTaskStatus.QUEUED, claimed_by=None, deadline=deadline, sent_at=now, updated_at=now
        ).returning(*_REF_COLUMNS)
    ).first()
    return _refs([row])[0] if row is not None else None


def take_back_in_flight(session: Session) -> int:
    """Every node sent and not claimed, or running, is queued again and unsent (claim and deadline cleared):
    the carrier of its message is gone (an in-process queue whose server stopped). Its attempts stay, so a
    node that keeps stopping its process still reaches the attempts cap. Returns the rows taken back."""
    stmt = (
        update(NodeTask)
        .where(text(IN_FLIGHT_SQL))
        .values(status=NodeTaskStatus.QUEUED, claimed_by=None, deadline=None, sent_at=None, updated_at=utcnow())
    )
    return int(session.execute(stmt).rowcount or 0)  # type: ignore[attr-defined]


def items_without_node_tasks(session: Session, *, job_id: str, limit: int = 500) -> list[Item]:
    """Open items of the job whose nodes were not dispatched yet, in input order."""
    has_tasks = exists().where(NodeTask.item_id == Item.id)
    stmt = (
        select(Item)
        .where(Item.job_id == job_id, Item.status.in_(ITEM_OPEN), ~has_tasks)
        .order_by(Item.position)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def live_node_tasks(session: Session, *, job_id: str, now: datetime) -> int:
    """Nodes of the job that a worker is running right now (claimed, lease not run out)."""
    stmt = (
        select(func.count())
        .select_from(NodeTask)
        .where(NodeTask.job_id == job_id, NodeTask.status == NodeTaskStatus.RUNNING, NodeTask.deadline >= now)
    )
    return int(session.scalar(stmt) or 0)


def jobs_past_window(session: Session, *, now: datetime, statuses: Sequence[str]) -> list[str]:
    """Open jobs whose completion window (``expires_at``) has passed."""
    stmt = select(Job.id).where(
        Job.status.in_(list(statuses)), and_(Job.expires_at.is_not(None), Job.expires_at < now)
    )
    return list(session.scalars(stmt))


def lock_item(session: Session, *, item_id: int) -> str | None:
    """Lock the item's row until the transaction ends and return its status (None: no such item). Whoever
    decides that an item is complete holds this lock, so two last nodes finishing at once cannot both miss it."""
    return session.scalars(select(Item.status).where(Item.id == item_id).with_for_update()).one_or_none()


def fail_item(session: Session, *, job_id: str, item_id: int, error: dict[str, Any]) -> bool:
    """The item fails with ``error`` (its row locked first) and none of its unfinished nodes will run; False when
    it was already terminal. Settling the job is the caller's."""
    if lock_item(session, item_id=item_id) not in ITEM_OPEN:
        return False
    finish_items(session, job_id=job_id, outcomes=[ItemOutcome(item_id, ItemStatus.FAILED, None, error)])
    fail_open_node_tasks(session, item_id=item_id)
    return True


def close_job_node_tasks(session: Session, *, job_id: str) -> int:
    """The job stopped (cancelled, expired): its nodes that wait or are queued will not run. Rows another
    transaction holds are skipped, never waited for: that is a worker's claim or store of a stale message, which
    closes its own row (waiting here while it waits for a row this statement locked would deadlock), and the
    claim of any row left over finds its job closed."""
    now = utcnow()
    locked = (
        select(NodeTask.id)
        .where(NodeTask.job_id == job_id, NodeTask.status.in_([NodeTaskStatus.WAITING, NodeTaskStatus.QUEUED]))
        .with_for_update(skip_locked=True)
    )
    result = session.execute(
        update(NodeTask)
        .where(NodeTask.id.in_(locked.scalar_subquery()))
        .values(status=NodeTaskStatus.FAILED, deadline=None, finished_at=now, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def queued_jobs_older_than(session: Session, *, before: datetime, limit: int = 50) -> list[str]:
    """Queued jobs created before ``before`` (their dispatch after submission did not happen)."""
    stmt = (
        select(Job.id)
        .where(Job.status == JobStatus.QUEUED, Job.created_at < before)
        .order_by(Job.priority, Job.id)
    )
    return list(session.scalars(stmt.limit(limit)))


def running_jobs_started_before(session: Session, *, before: datetime) -> list[str]:
    """Running jobs whose dispatch started before ``before`` (candidates for an interrupted dispatch)."""
    stmt = select(Job.id).where(Job.status == JobStatus.RUNNING, Job.started_at < before).order_by(Job.id)
    return list(session.scalars(stmt))


def items_with_every_node_done(session: Session, *, limit: int = 200) -> list[tuple[int, str]]:
    """``(item_id, job_id)`` of open items of open jobs whose dispatched nodes are all stored: their outcome is
    due (a worker stopped between storing an item's last node and finishing the item)."""
    unfinished = [NodeTaskStatus.WAITING, NodeTaskStatus.QUEUED, NodeTaskStatus.RUNNING]
    dispatched = exists().where(NodeTask.item_id == Item.id)
    pending = exists().where(NodeTask.item_id == Item.id, NodeTask.status.in_(unfinished))
    stmt = (
        select(Item.id, Item.job_id)
        .join(Job, Job.id == Item.job_id)
        .where(
            Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]),
            Item.status.in_(ITEM_OPEN),
            dispatched,
            ~pending,
        )
        .limit(limit)
    )
    return [(int(item_id), job_id) for item_id, job_id in session.execute(stmt)]


def batch_of_job(session: Session, *, job_id: str) -> Batch | None:
    """The OpenAI batch whose job this is (None for a plain job)."""
    return session.scalars(select(Batch).where(Batch.job_id == job_id)).first()


def node_task_timeline(session: Session, *, job_id: str, limit: int = 20_000) -> list[tuple[Any, ...]]:
    """``(node_id, kind, item_id, started_at, finished_at, status, attempts)`` of the job's nodes that ran, in
    the order they started (for the job's trace)."""
    stmt = (
        select(
            NodeTask.node_id,
            NodeTask.kind,
            NodeTask.item_id,
            NodeTask.started_at,
            NodeTask.finished_at,
            NodeTask.status,
            NodeTask.attempts,
        )
        .where(NodeTask.job_id == job_id, NodeTask.started_at.is_not(None))
        .order_by(NodeTask.started_at)
        .limit(limit)
    )
    return [tuple(row) for row in session.execute(stmt)]
