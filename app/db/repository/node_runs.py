"""The statements one node task runs, on the hot path of the distributed executor: built once (Core, on the
tables, with bound parameters), so a task pays for neither building SQL expressions nor the ORM's bookkeeping.
A worker runs several of these per node at hundreds of nodes per second."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import Connection, Table, bindparam, case, func, select, update
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
from app.db.repository.node_tasks import NodeTaskRef

_T: Table = NodeTask.__table__  # type: ignore[assignment]
_R: Table = NodeResult.__table__  # type: ignore[assignment]
_J: Table = Job.__table__  # type: ignore[assignment]
_I: Table = Item.__table__  # type: ignore[assignment]
_M: Table = JobMetrics.__table__  # type: ignore[assignment]
_OPEN_JOB = [JobStatus.QUEUED.value, JobStatus.RUNNING.value]
_OPEN_ITEM = [s.value for s in ITEM_OPEN]
_UNFINISHED = [NodeTaskStatus.WAITING.value, NodeTaskStatus.QUEUED.value, NodeTaskStatus.RUNNING.value]


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
        deadline=case((_REMAINING <= 0, bindparam("b_deadline")), else_=_T.c.deadline),
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


def store_result(
    session: Session,
    *,
    job_id: str,
    item_id: int,
    node_id: str,
    value: Any,
    duration_ms: float,
    attempt: int,
    now: datetime,
) -> bool:
    """``INSERT ... ON CONFLICT DO NOTHING`` of the node's result and its row marked done; False when another
    delivery had stored it (the row is done either way)."""
    inserted = (
        _conn(session)
        .execute(
            _insert_result(session),
            {
                "job_id": job_id,
                "item_id": item_id,
                "node_id": node_id,
                "value": value,
                "duration_ms": duration_ms,
                "attempt": attempt,
                "created_at": now,
            },
        )
        .first()
    )
    _conn(session).execute(_DONE, {"b_item": item_id, "b_node": node_id, "b_now": now})
    return inserted is not None


def release(
    session: Session, *, job_id: str, item_id: int, node_ids: Sequence[str], deadline: datetime, now: datetime
) -> list[NodeTaskRef]:
    """Count down one dependency of each of ``node_ids`` while the job is open; returns those that became queued
    (see :func:`app.db.repository.node_tasks.release_dependents`)."""
    if not node_ids:
        return []
    params = {
        "b_job": job_id,
        "b_item": item_id,
        "b_nodes": list(node_ids),
        "b_deadline": deadline,
        "b_now": now,
    }
    rows = _conn(session).execute(_RELEASE, params)
    return [NodeTaskRef(r[0], int(r[1]), r[2], int(r[3]), r[4], int(r[5])) for r in rows if r[6] == "queued"]


def job_status(session: Session, *, job_id: str) -> str | None:
    return _conn(session).execute(_JOB_STATUS, {"b_job": job_id}).scalar_one_or_none()


def lock_item_if_done(session: Session, *, item_id: int) -> bool:
    """Lock the item's row, then tell whether it is open with every node stored. The lock comes first: of two
    workers storing an item's last two nodes at once, the second waits and then sees the first one's node."""
    status = _conn(session).execute(_LOCK_ITEM, {"b_item": item_id}).scalar_one_or_none()
    if status not in _OPEN_ITEM:
        return False
    return not _conn(session).execute(_COUNT_UNFINISHED, {"b_item": item_id}).scalar_one()


@dataclass(frozen=True, slots=True)
class JobProgress:
    completed: int
    failed: int
    cancelled: int
    total: int

    @property
    def finished(self) -> bool:
        return self.completed + self.failed + self.cancelled >= self.total


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


def add_metrics(
    session: Session,
    *,
    job_id: str,
    calls: int,
    input_tokens: int,
    output_tokens: int,
    cost: float,
    latency_ms_total: float,
    latency_ms_max: float,
    now: datetime,
) -> None:
    _conn(session).execute(
        _METRICS,
        {
            "b_job": job_id,
            "b_calls": calls,
            "b_in": input_tokens,
            "b_out": output_tokens,
            "b_cost": cost,
            "b_latency": latency_ms_total,
            "b_max": latency_ms_max,
            "b_now": now,
        },
    )


# -- PostgreSQL, autocommit, on a raw psycopg connection (app.db.direct): a claim and a store in one round trip
# each. Each is one statement, so it is its own transaction: no BEGIN and COMMIT round trips around it.
# Data-modifying CTEs run exactly once whether or not the final SELECT reads them. The statements are prepared
# on each connection (psycopg prepares a statement run more than a few times).

_CLAIM_ONE = """
    WITH claimed AS (
        UPDATE node_tasks AS nt
        SET status = 'running', attempts = nt.attempts + 1, claimed_by = %(token)s, deadline = %(deadline)s,
            started_at = %(now)s, updated_at = %(now)s
        FROM jobs AS j, items AS i
        WHERE nt.item_id = %(item)s AND nt.node_id = %(node)s AND nt.status = 'queued' AND nt.attempts < %(cap)s
          AND j.id = nt.job_id AND j.status IN ('queued', 'running')
          AND i.id = nt.item_id AND i.status IN ('pending', 'running')
        RETURNING nt.attempts, i.status AS item_status, i.input, i.custom_id, j.pipeline_name, j.pipeline_id
    ), started AS (
        UPDATE items SET status = 'running', started_at = COALESCE(started_at, %(now)s)
        WHERE id = %(item)s AND status = 'pending' AND EXISTS (SELECT 1 FROM claimed)
    )
    SELECT c.attempts, c.item_status, c.input, c.custom_id, c.pipeline_name, c.pipeline_id,
           (SELECT COALESCE(jsonb_object_agg(r.node_id, r.value), CAST('{}' AS jsonb))
            FROM node_results AS r WHERE r.item_id = %(item)s) AS stored
    FROM claimed AS c
"""

# The start of both stores: insert the result (a re-delivery finds it there already) and mark the node done.
# Each store continues this WITH list; its further steps check EXISTS (SELECT 1 FROM ins), so they happen once.
_STORE_RESULT = """
    WITH ins AS (
        INSERT INTO node_results (job_id, item_id, node_id, value, duration_ms, attempt, created_at)
        VALUES (%(job)s, %(item)s, %(node)s, %(value)s, %(duration)s, %(attempt)s, %(now)s)
        ON CONFLICT (job_id, item_id, node_id) DO NOTHING
        RETURNING id
    ), done AS (
        UPDATE node_tasks SET status = 'done', deadline = NULL, finished_at = %(now)s, updated_at = %(now)s
        WHERE item_id = %(item)s AND node_id = %(node)s
    ), """

_STORE_ONE = _STORE_RESULT + """rel AS (
        UPDATE node_tasks
        SET waiting = waiting - 1,
            status = CASE WHEN waiting - 1 <= 0 THEN 'queued' ELSE status END,
            deadline = CASE WHEN waiting - 1 <= 0 THEN %(deadline)s ELSE deadline END,
            updated_at = %(now)s
        WHERE item_id = %(item)s AND node_id = ANY(CAST(%(deps)s AS varchar[])) AND status = 'waiting'
          AND EXISTS (SELECT 1 FROM ins)
          AND EXISTS (SELECT 1 FROM jobs WHERE id = %(job)s AND status IN ('queued', 'running'))
        RETURNING job_id, item_id, node_id, attempts, queue, priority, status
    )
    SELECT (SELECT count(*) FROM ins), rel.job_id, rel.item_id, rel.node_id, rel.attempts, rel.queue,
           rel.priority, rel.status, (SELECT status FROM jobs WHERE id = %(job)s)
    FROM (SELECT 1) AS one LEFT JOIN rel ON true
"""

_ITEM_VALUES = "SELECT node_id, value FROM node_results WHERE item_id = %(item)s"


def claim_one(
    conn: psycopg.Connection,
    *,
    item_id: int,
    node_id: str,
    token: str,
    max_attempts: int,
    deadline: datetime,
    now: datetime,
) -> tuple[QuickClaim, dict[str, Any]] | None:
    """Claim a queued node of an open job and item below the attempts cap, mark its item running, and read the
    item's stored values, in one statement. None when the claim does not hold (the caller then decides on the
    locked row)."""
    params = {"item": item_id, "node": node_id, "token": token, "cap": max_attempts, "deadline": deadline, "now": now}
    row = conn.execute(_CLAIM_ONE, params, prepare=True).fetchone()
    if row is None:
        return None
    claim = QuickClaim(int(row[0]), row[1], row[2], row[3], row[4], int(row[5]))
    return claim, dict(row[6] or {})


def item_values_direct(conn: psycopg.Connection, *, item_id: int) -> dict[str, Any]:
    """``{node_id: encoded value}`` of the item's stored nodes."""
    return {node_id: value for node_id, value in conn.execute(_ITEM_VALUES, {"item": item_id}, prepare=True)}


def _result_params(
    job_id: str, item_id: int, node_id: str, value: Any, duration_ms: float, attempt: int, now: datetime
) -> dict[str, Any]:
    """The parameters of :data:`_STORE_RESULT`."""
    return {
        "job": job_id,
        "item": item_id,
        "node": node_id,
        "value": Jsonb(value),
        "duration": duration_ms,
        "attempt": attempt,
        "now": now,
    }


def store_one(
    conn: psycopg.Connection,
    *,
    job_id: str,
    item_id: int,
    node_id: str,
    value: Any,
    duration_ms: float,
    attempt: int,
    dependents: Sequence[str],
    deadline: datetime,
    now: datetime,
) -> tuple[bool, list[NodeTaskRef], str | None]:
    """Store the result (``ON CONFLICT DO NOTHING``), mark the node done and, if this delivery stored it and the
    job is open, count down its dependents, in one statement. Returns (stored by this call, the dependents that
    became queued, the job's status)."""
    params = _result_params(job_id, item_id, node_id, value, duration_ms, attempt, now)
    params.update(deps=list(dependents), deadline=deadline)
    rows = conn.execute(_STORE_ONE, params, prepare=True).fetchall()
    inserted = bool(rows and rows[0][0])
    ready = [
        NodeTaskRef(r[1], int(r[2]), r[3], int(r[4]), r[5], int(r[6]))
        for r in rows
        if r[3] is not None and r[7] == "queued"
    ]
    return inserted, ready, rows[0][8] if rows else None


_STORE_LAST = _STORE_RESULT + """open_item AS (
        SELECT id FROM items
        WHERE id = %(item)s AND status IN ('pending', 'running') AND EXISTS (SELECT 1 FROM ins)
        FOR UPDATE
    ), progress AS (
        UPDATE jobs
        SET results_seq = results_seq + 1, completed_items = completed_items + %(completed)s,
            failed_items = failed_items + %(failed)s, updated_at = %(now)s
        WHERE id = %(job)s AND EXISTS (SELECT 1 FROM open_item)
        RETURNING results_seq, completed_items, failed_items, cancelled_items, total_items
    ), finished AS (
        UPDATE items
        SET status = %(status)s, output = %(output)s, error = %(error)s, finished_at = %(now)s,
            result_seq = (SELECT results_seq FROM progress)
        WHERE id = %(item)s AND EXISTS (SELECT 1 FROM progress)
    ), metrics AS (
        UPDATE job_metrics
        SET llm_calls = llm_calls + %(calls)s, input_tokens = input_tokens + %(tokens_in)s,
            output_tokens = output_tokens + %(tokens_out)s, cost = cost + %(cost)s,
            latency_ms_total = latency_ms_total + %(latency)s,
            latency_ms_max = GREATEST(latency_ms_max, %(latency_max)s), updated_at = %(now)s
        WHERE job_id = %(job)s AND %(calls)s > 0 AND EXISTS (SELECT 1 FROM progress)
    )
    SELECT (SELECT count(*) FROM ins), p.completed_items, p.failed_items, p.cancelled_items, p.total_items
    FROM (SELECT 1) AS one LEFT JOIN progress AS p ON true
"""


@dataclass(frozen=True, slots=True)
class ItemMetrics:
    """An item's LLM calls, tokens, cost and latency, added to its job's totals when it finishes."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    latency_ms_total: float = 0.0
    latency_ms_max: float = 0.0


def store_last(
    conn: psycopg.Connection,
    *,
    job_id: str,
    item_id: int,
    node_id: str,
    value: Any,
    duration_ms: float,
    attempt: int,
    status: ItemStatus,
    output: Any,
    error: Any,
    metrics: ItemMetrics,
    now: datetime,
) -> tuple[bool, JobProgress | None]:
    """For the node every other node of its item leads to: store its result and, if this delivery stored it and
    the item is still open, the item's outcome, its place in the job's completion order, the job's counters and
    metrics, in one statement. Returns (stored by this call, the job's counts after it, when the item finished
    here)."""
    params = _result_params(job_id, item_id, node_id, value, duration_ms, attempt, now)
    row = conn.execute(
        _STORE_LAST,
        {
            **params,
            "completed": int(status == ItemStatus.COMPLETED),
            "failed": int(status == ItemStatus.FAILED),
            "status": status.value,
            "output": Jsonb(output),
            "error": Jsonb(error),
            "calls": metrics.calls,
            "tokens_in": metrics.input_tokens,
            "tokens_out": metrics.output_tokens,
            "cost": metrics.cost,
            "latency": metrics.latency_ms_total,
            "latency_max": metrics.latency_ms_max,
        },
        prepare=True,
    ).fetchone()
    assert row is not None  # the statement always returns one row
    if row[1] is None:
        return bool(row[0]), None
    return bool(row[0]), JobProgress(int(row[1]), int(row[2]), int(row[3]), int(row[4]))
