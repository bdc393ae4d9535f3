"""The Core statements of the node store (:mod:`app.db.repository.node_store`): built once (on the tables, with
bound parameters), so a node task pays for neither building SQL expressions nor the ORM's bookkeeping. Each
function runs in the caller's transaction; :class:`~app.db.repository.node_store.core.CoreNodeStore` composes
them into the store's operations, and the sweeper finishes items with :func:`finish_item`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, DateTime, Table, and_, bindparam, case, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.models import (
    ITEM_OPEN,
    Item,
    ItemStatus,
    Job,
    JobMetrics,
    JobStatus,
    NodeResult,
    NodeTask,
    NodeTaskStatus,
)
from app.db.repository.node_store.protocol import (
    INLINE_KIND,
    Hold,
    ItemEnd,
    ItemEnder,
    ItemMetrics,
    JobProgress,
    NodeValue,
)
from app.db.repository.node_tasks import NodeTaskRef

_T: Table = NodeTask.__table__  # type: ignore[assignment]
_R: Table = NodeResult.__table__  # type: ignore[assignment]
_J: Table = Job.__table__  # type: ignore[assignment]
_I: Table = Item.__table__  # type: ignore[assignment]
_M: Table = JobMetrics.__table__  # type: ignore[assignment]
_OPEN_JOB = [JobStatus.QUEUED.value, JobStatus.RUNNING.value]
_OPEN_ITEM = [s.value for s in ITEM_OPEN]
_UNFINISHED = [NodeTaskStatus.WAITING.value, NodeTaskStatus.QUEUED.value, NodeTaskStatus.RUNNING.value]
_QUEUED = NodeTaskStatus.QUEUED.value


@dataclass(frozen=True, slots=True)
class ClaimRow:
    """The node's row (locked), with what its claim decides on: the job's and the item's state and input."""

    row_id: int
    status: str
    attempts: int
    deadline: datetime | None
    claimed_by: str | None
    job_status: str
    pipeline_name: str
    pipeline_id: int
    item_status: str
    item_input: dict[str, Any]
    custom_id: str


_CLAIM = (
    select(
        _T.c.id,
        _T.c.status,
        _T.c.attempts,
        _T.c.deadline,
        _T.c.claimed_by,
        _J.c.status,
        _J.c.pipeline_name,
        _J.c.pipeline_id,
        _I.c.status,
        _I.c.input,
        _I.c.custom_id,
    )
    .select_from(_T.join(_J, _J.c.id == _T.c.job_id).join(_I, _I.c.id == _T.c.item_id))
    .where(_T.c.item_id == bindparam("b_item"), _T.c.node_id == bindparam("b_node"))
    .with_for_update(of=_T)
)

_START = (
    update(_T)
    .where(_T.c.id == bindparam("b_row"))
    .values(
        status=NodeTaskStatus.RUNNING.value,
        attempts=_T.c.attempts + 1,
        claimed_by=bindparam("b_token"),
        deadline=bindparam("b_deadline"),
        started_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
    .returning(_T.c.attempts)
)

_ITEM_RUNNING = (
    update(_I)
    .where(_I.c.id == bindparam("b_item"), _I.c.status == ItemStatus.PENDING.value)
    .values(status=ItemStatus.RUNNING.value, started_at=func.coalesce(_I.c.started_at, bindparam("b_now")))
)

_VALUES = select(_R.c.node_id, _R.c.value).where(_R.c.item_id == bindparam("b_item"))

_DONE = (
    update(_T)
    .where(_T.c.item_id == bindparam("b_item"), _T.c.node_id == bindparam("b_node"))
    .values(
        status=NodeTaskStatus.DONE.value,
        deadline=None,
        finished_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)

# the common claim in one statement: a queued node of an open job and item, under the attempts cap (PostgreSQL)
_CLAIM_QUEUED = (
    update(_T)
    .where(
        _T.c.item_id == bindparam("b_item"),
        _T.c.node_id == bindparam("b_node"),
        _T.c.status == NodeTaskStatus.QUEUED.value,
        _T.c.attempts < bindparam("b_cap"),
        _J.c.id == _T.c.job_id,
        _J.c.status.in_(_OPEN_JOB),
        _I.c.id == _T.c.item_id,
        _I.c.status.in_(_OPEN_ITEM),
    )
    .values(
        status=NodeTaskStatus.RUNNING.value,
        attempts=_T.c.attempts + 1,
        claimed_by=bindparam("b_token"),
        deadline=bindparam("b_deadline"),
        started_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
    .returning(_T.c.attempts, _I.c.status, _I.c.input, _I.c.custom_id, _J.c.pipeline_name, _J.c.pipeline_id)
)

_REMAINING = _T.c.waiting - 1
_HOLD_UNTIL = bindparam("b_hold_until", type_=DateTime(timezone=True))
# a dependent run by the storing delivery itself (see Hold)
_HELD = and_(_HOLD_UNTIL.is_not(None), or_(_T.c.queue == bindparam("b_hold"), _T.c.kind == INLINE_KIND))
# dependents are released only while the job is open: a cancel stops the dispatch in the same statement
_RELEASE = (
    update(_T)
    .where(
        _T.c.item_id == bindparam("b_item"),
        _T.c.node_id.in_(bindparam("b_nodes", expanding=True)),
        _T.c.status == NodeTaskStatus.WAITING.value,
        select(_J.c.id).where(_J.c.id == bindparam("b_job"), _J.c.status.in_(_OPEN_JOB)).exists(),
    )
    .values(
        waiting=_REMAINING,
        status=case((_REMAINING <= 0, NodeTaskStatus.QUEUED.value), else_=_T.c.status),
        # a held dependent (see Hold) is run by the storing delivery itself: it counts as sent (refills leave
        # it alone), due by the later deadline (the sweeper re-sends it if that delivery dies first)
        deadline=case(
            (and_(_REMAINING <= 0, _HELD), _HOLD_UNTIL),
            (_REMAINING <= 0, bindparam("b_deadline")),
            else_=_T.c.deadline,
        ),
        sent_at=case((and_(_REMAINING <= 0, _HELD), bindparam("b_now")), else_=_T.c.sent_at),
        updated_at=bindparam("b_now"),
    )
    .returning(_T.c.job_id, _T.c.item_id, _T.c.node_id, _T.c.attempts, _T.c.queue, _T.c.priority, _T.c.status)
)

_JOB_STATUS = select(_J.c.status).where(_J.c.id == bindparam("b_job"))

_LOCK_ITEM = select(_I.c.status).where(_I.c.id == bindparam("b_item")).with_for_update()
_COUNT_UNFINISHED = (
    select(func.count())
    .select_from(_T)
    .where(_T.c.item_id == bindparam("b_item"), _T.c.status.in_(_UNFINISHED))
)
_JOB_PROGRESS = (
    update(_J)
    .where(_J.c.id == bindparam("b_job"))
    .values(
        results_seq=_J.c.results_seq + 1,
        completed_items=_J.c.completed_items + bindparam("b_completed"),
        failed_items=_J.c.failed_items + bindparam("b_failed"),
        updated_at=bindparam("b_now"),
    )
    .returning(
        _J.c.results_seq, _J.c.completed_items, _J.c.failed_items, _J.c.cancelled_items, _J.c.total_items
    )
)
_ITEM_DONE = (
    update(_I)
    .where(_I.c.id == bindparam("b_item"))
    .values(
        status=bindparam("b_status"),
        output=bindparam("b_output"),
        error=bindparam("b_error"),
        result_seq=bindparam("b_seq"),
        finished_at=bindparam("b_now"),
    )
)
_METRICS = (
    update(_M)
    .where(_M.c.job_id == bindparam("b_job"))
    .values(
        llm_calls=_M.c.llm_calls + bindparam("b_calls"),
        input_tokens=_M.c.input_tokens + bindparam("b_in"),
        output_tokens=_M.c.output_tokens + bindparam("b_out"),
        cost=_M.c.cost + bindparam("b_cost"),
        latency_ms_total=_M.c.latency_ms_total + bindparam("b_latency"),
        latency_ms_max=case(
            (_M.c.latency_ms_max < bindparam("b_max"), bindparam("b_max")), else_=_M.c.latency_ms_max
        ),
        updated_at=bindparam("b_now"),
    )
)

_INSERT_RESULT: dict[str, Any] = {}


def _conn(session: Session) -> Connection:
    """The session's connection in its current transaction: Core statements skip the ORM's execution path."""
    return session.connection()


def _insert_result(session: Session) -> Any:
    dialect = session.get_bind().dialect.name
    stmt = _INSERT_RESULT.get(dialect)
    if stmt is None:
        module: Any = postgresql if dialect == "postgresql" else sqlite
        stmt = (
            module.insert(_R)
            .on_conflict_do_nothing(index_elements=["job_id", "item_id", "node_id"])
            .returning(_R.c.id)
        )
        _INSERT_RESULT[dialect] = stmt
    return stmt


@dataclass(frozen=True, slots=True)
class QuickClaim:
    attempts: int
    item_status: str
    item_input: dict[str, Any]
    custom_id: str
    pipeline_name: str
    pipeline_id: int


def claim_queued(
    session: Session,
    *,
    item_id: int,
    node_id: str,
    token: str,
    max_attempts: int,
    deadline: datetime,
    now: datetime,
) -> QuickClaim | None:
    """Claim a queued node of an open job and item below the attempts cap in one statement (PostgreSQL); None
    when any of that does not hold (or on SQLite): the caller then decides on the locked row."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    row = (
        _conn(session)
        .execute(
            _CLAIM_QUEUED,
            {
                "b_item": item_id,
                "b_node": node_id,
                "b_cap": max_attempts,
                "b_token": token,
                "b_deadline": deadline,
                "b_now": now,
            },
        )
        .first()
    )
    if row is None:
        return None
    return QuickClaim(int(row[0]), row[1], row[2], row[3], row[4], int(row[5]))


def read_claim(session: Session, *, item_id: int, node_id: str) -> ClaimRow | None:
    """Lock the node's row and read it with its job's and item's state (one statement)."""
    row = _conn(session).execute(_CLAIM, {"b_item": item_id, "b_node": node_id}).first()
    if row is None:
        return None
    return ClaimRow(
        int(row[0]), row[1], int(row[2]), row[3], row[4], row[5], row[6], int(row[7]), row[8], row[9], row[10]
    )


def start_claim(session: Session, *, row_id: int, token: str, deadline: datetime, now: datetime) -> int:
    """The claimed delivery runs the node: running, one more attempt, leased until ``deadline``."""
    params = {"b_row": row_id, "b_token": token, "b_deadline": deadline, "b_now": now}
    return int(_conn(session).execute(_START, params).scalar_one())


def mark_item_running(session: Session, *, item_id: int, now: datetime) -> None:
    _conn(session).execute(_ITEM_RUNNING, {"b_item": item_id, "b_now": now})


def item_values(session: Session, *, item_id: int) -> dict[str, Any]:
    """``{node_id: encoded value}`` of the item's stored nodes."""
    return {node_id: value for node_id, value in _conn(session).execute(_VALUES, {"b_item": item_id})}


def store_result(session: Session, value: NodeValue) -> bool:
    """``INSERT ... ON CONFLICT DO NOTHING`` of the node's result and its row marked done; False when another
    delivery had stored it (the row is done either way)."""
    inserted = (
        _conn(session)
        .execute(
            _insert_result(session),
            {
                "job_id": value.job_id,
                "item_id": value.item_id,
                "node_id": value.node_id,
                "value": value.value,
                "duration_ms": value.duration_ms,
                "attempt": value.attempt,
                "created_at": value.now,
            },
        )
        .first()
    )
    _conn(session).execute(_DONE, {"b_item": value.item_id, "b_node": value.node_id, "b_now": value.now})
    return inserted is not None


def release(
    session: Session,
    *,
    job_id: str,
    item_id: int,
    node_ids: Sequence[str],
    deadline: datetime,
    now: datetime,
    hold: Hold | None = None,
) -> list[NodeTaskRef]:
    """Count down one dependency of each of ``node_ids`` while the job is open; returns those that became queued
    (see :func:`app.db.repository.node_tasks.release_dependents`); ``hold``: see :class:`Hold`."""
    if not node_ids:
        return []
    params = {
        "b_job": job_id,
        "b_item": item_id,
        "b_nodes": list(node_ids),
        "b_deadline": deadline,
        "b_now": now,
        "b_hold": hold.queue if hold is not None else None,
        "b_hold_until": hold.until if hold is not None else None,
    }
    rows = _conn(session).execute(_RELEASE, params)
    return [NodeTaskRef(r[0], int(r[1]), r[2], int(r[3]), r[4], int(r[5])) for r in rows if r[6] == _QUEUED]


def job_status(session: Session, *, job_id: str) -> str | None:
    return _conn(session).execute(_JOB_STATUS, {"b_job": job_id}).scalar_one_or_none()


def lock_open_item(session: Session, *, item_id: int) -> bool:
    """Lock the item's row and tell whether it is open."""
    return _conn(session).execute(_LOCK_ITEM, {"b_item": item_id}).scalar_one_or_none() in _OPEN_ITEM


def lock_item_if_done(session: Session, *, item_id: int) -> bool:
    """Lock the item's row, then tell whether it is open with every node stored. The lock comes first: of two
    workers storing an item's last two nodes at once, the second waits and then sees the first one's node."""
    if not lock_open_item(session, item_id=item_id):
        return False
    return not _conn(session).execute(_COUNT_UNFINISHED, {"b_item": item_id}).scalar_one()


def finish_locked_item(
    session: Session, *, job_id: str, item_id: int, status: ItemStatus, output: Any, error: Any, now: datetime
) -> JobProgress:
    """Store the outcome of an item whose row this transaction locked (open, checked): it takes the next place
    in the job's completion order, and the job's counters move in the same statement."""
    row = (
        _conn(session)
        .execute(
            _JOB_PROGRESS,
            {
                "b_job": job_id,
                "b_completed": int(status == ItemStatus.COMPLETED),
                "b_failed": int(status == ItemStatus.FAILED),
                "b_now": now,
            },
        )
        .one()
    )
    _conn(session).execute(
        _ITEM_DONE,
        {
            "b_item": item_id,
            "b_status": status.value,
            "b_output": output,
            "b_error": error,
            "b_seq": int(row[0]),
            "b_now": now,
        },
    )
    return JobProgress(int(row[1]), int(row[2]), int(row[3]), int(row[4]))


def add_metrics(session: Session, *, job_id: str, metrics: ItemMetrics, now: datetime) -> None:
    """Add a finished item's LLM calls, tokens, cost and latency to its job's totals (nothing without calls)."""
    if not metrics.calls:
        return
    _conn(session).execute(
        _METRICS,
        {
            "b_job": job_id,
            "b_calls": metrics.calls,
            "b_in": metrics.input_tokens,
            "b_out": metrics.output_tokens,
            "b_cost": metrics.cost,
            "b_latency": metrics.latency_ms_total,
            "b_max": metrics.latency_ms_max,
            "b_now": now,
        },
    )


def finish_open_item(
    session: Session, *, job_id: str, item_id: int, end: ItemEnd, now: datetime
) -> JobProgress | None:
    """Store ``end`` as the outcome of the item if it is open (its row locked first), with the job's counters
    and metrics; None when it was closed."""
    if not lock_open_item(session, item_id=item_id):
        return None
    progress = finish_locked_item(
        session, job_id=job_id, item_id=item_id, status=end.status, output=end.output, error=end.error, now=now
    )
    add_metrics(session, job_id=job_id, metrics=end.metrics, now=now)
    return progress


def finish_item(
    session: Session, *, job_id: str, item_id: int, end: ItemEnder, now: datetime
) -> JobProgress | None:
    """Store the outcome of an open item none of whose nodes is left unfinished, as ``end`` decides it (it may
    read the item's stored values), with the job's counters and metrics; None while the item is closed or some
    node is unfinished."""
    if not lock_item_if_done(session, item_id=item_id):
        return None
    outcome = end(lambda: item_values(session, item_id=item_id))
    progress = finish_locked_item(
        session,
        job_id=job_id,
        item_id=item_id,
        status=outcome.status,
        output=outcome.output,
        error=outcome.error,
        now=now,
    )
    add_metrics(session, job_id=job_id, metrics=outcome.metrics, now=now)
    return progress
