"""The node store on a raw sqlite3 connection (SQLite only): the hot path of a node task in the embedded mode.

The claims, the stores and the reads of an item's values run as prepared statements on the one connection of an
:class:`app.db.sqlite_writer.SqliteWriter`, whose writer thread runs the task threads' operations together, in
one transaction per batch (SQLite has one writer; SQLAlchemy's per-statement work and a transaction per
operation cost more CPU than the statements). Each operation is a unit of work that is correct alone: it reads
what it decides on inside the write transaction, so no other writer changes it meanwhile. A claim that is not
the common one (a queued node of an open job and item) and the rarer operations go through
:class:`~app.db.repository.node_store.core.CoreNodeStore`, whose transactions queue on the same write lock
(:mod:`app.db.sqlite_lock`).

Values are stored as SQLAlchemy stores them on SQLite (``json.dumps`` text, ``null`` for None; timestamps as
``YYYY-MM-DD HH:MM:SS.ffffff`` in UTC), so either store reads what the other wrote.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import cache, partial
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import ITEM_OPEN, ItemStatus, JobStatus, NodeTaskStatus
from app.db.repository.node_store.core import CoreNodeStore, JobSettler, settle_due
from app.db.repository.node_store.protocol import (
    INLINE_KIND,
    Claim,
    ClaimedItem,
    ClaimRequest,
    ClaimStatus,
    Hold,
    ItemEnd,
    ItemEnder,
    ItemMetrics,
    JobProgress,
    LastStored,
    NodeValue,
    Stored,
)
from app.db.repository.node_tasks import NodeTaskRef
from app.db.sqlite_writer import SqliteWriter

T = TypeVar("T")


def _literals(*statuses: StrEnum) -> str:
    """``'a', 'b'``: enum values as SQL string literals (they are plain lowercase words)."""
    assert all(s.value.isidentifier() for s in statuses)
    return ", ".join(f"'{s.value}'" for s in sorted(statuses))


_WAITING = _literals(NodeTaskStatus.WAITING)
_QUEUED = _literals(NodeTaskStatus.QUEUED)
_RUNNING = _literals(NodeTaskStatus.RUNNING)
_DONE = _literals(NodeTaskStatus.DONE)
_UNFINISHED = _literals(NodeTaskStatus.WAITING, NodeTaskStatus.QUEUED, NodeTaskStatus.RUNNING)
_OPEN_ITEM = _literals(*ITEM_OPEN)
_OPEN_JOB = _literals(JobStatus.QUEUED, JobStatus.RUNNING)
_OPEN_JOBS = frozenset({JobStatus.QUEUED.value, JobStatus.RUNNING.value})
_OPEN_ITEMS = frozenset(s.value for s in ITEM_OPEN)

# the common claim: a queued node of an open job and item below the attempts cap becomes running; it returns what
# the node task needs (its item, its job's pipeline, the item's stored values) in the same statement
_CLAIM = f"""
    UPDATE node_tasks
    SET status = {_RUNNING}, attempts = attempts + 1, claimed_by = ?1, deadline = ?2, started_at = ?3, updated_at = ?3
    WHERE item_id = ?4 AND node_id = ?5 AND job_id = ?6 AND status = {_QUEUED} AND attempts < ?7
      AND EXISTS (SELECT 1 FROM jobs WHERE id = ?6 AND status IN ({_OPEN_JOB}))
      AND EXISTS (SELECT 1 FROM items WHERE id = ?4 AND status IN ({_OPEN_ITEM}))
    RETURNING attempts,
        (SELECT status FROM items WHERE id = ?4), (SELECT input FROM items WHERE id = ?4),
        (SELECT custom_id FROM items WHERE id = ?4), (SELECT pipeline_name FROM jobs WHERE id = ?6),
        (SELECT pipeline_id FROM jobs WHERE id = ?6),
        (SELECT json_group_object(node_id, value) FROM node_results WHERE item_id = ?4)
"""
_ITEM_RUNNING = f"""
    UPDATE items SET status = '{ItemStatus.RUNNING.value}', started_at = COALESCE(started_at, ?)
    WHERE id = ? AND status = '{ItemStatus.PENDING.value}'
"""
_VALUES = "SELECT node_id, value FROM node_results WHERE item_id = ?"
_RENEW = f"""
    UPDATE node_tasks SET deadline = ?, updated_at = ?
    WHERE item_id = ? AND node_id = ? AND claimed_by = ? AND status = {_RUNNING}
"""

# a result (a re-delivery finds it there already: no row returned), with the status of its job or item
_INSERT_RESULT = """
    INSERT INTO node_results (job_id, item_id, node_id, value, duration_ms, attempt, created_at)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
    ON CONFLICT (job_id, item_id, node_id) DO NOTHING
    RETURNING {returning}
"""
_INSERT_WITH_JOB = _INSERT_RESULT.format(returning="(SELECT status FROM jobs WHERE id = ?1)")
_INSERT_WITH_ITEM = _INSERT_RESULT.format(returning="(SELECT status FROM items WHERE id = ?2)")
_NODE_DONE = f"""
    UPDATE node_tasks SET status = {_DONE}, deadline = NULL, finished_at = ?1, updated_at = ?1
    WHERE item_id = ?2 AND node_id = ?3
"""
_JOB_STATUS = "SELECT status FROM jobs WHERE id = ?"
# a held dependent (see Hold) is run by the storing delivery itself: it counts as sent (refills leave it alone),
# due by the later deadline (the sweeper re-sends it if that delivery dies first); ``+status``: the planner takes
# the (item_id, node_id) index, not the one on status
_HELD = f"?2 IS NOT NULL AND (queue = ?1 OR kind = '{INLINE_KIND}')"
_RELEASE = f"""
    UPDATE node_tasks
    SET waiting = waiting - 1,
        status = CASE WHEN waiting - 1 <= 0 THEN {_QUEUED} ELSE status END,
        deadline = CASE WHEN waiting - 1 <= 0 AND {_HELD} THEN ?2 WHEN waiting - 1 <= 0 THEN ?3 ELSE deadline END,
        sent_at = CASE WHEN waiting - 1 <= 0 AND {_HELD} THEN ?4 ELSE sent_at END,
        updated_at = ?4
    WHERE item_id = ?5 AND +status = {_WAITING} AND node_id IN ({{nodes}})
    RETURNING job_id, item_id, node_id, attempts, queue, priority, status, kind
"""


@cache
def _release(count: int) -> str:
    """The release of ``count`` dependents (their ids are parameters 6 onwards)."""
    return _RELEASE.format(nodes=", ".join(f"?{6 + n}" for n in range(count)))


_ITEM_STATUS = "SELECT status FROM items WHERE id = ?"
_UNFINISHED_NODES = f"SELECT count(*) FROM node_tasks WHERE item_id = ? AND status IN ({_UNFINISHED})"
_JOB_PROGRESS = """
    UPDATE jobs
    SET results_seq = results_seq + 1, completed_items = completed_items + ?, failed_items = failed_items + ?,
        updated_at = ?
    WHERE id = ?
    RETURNING results_seq, completed_items, failed_items, cancelled_items, total_items, status
"""
_ITEM_DONE = """
    UPDATE items SET status = ?, output = ?, error = ?, result_seq = ?, finished_at = ? WHERE id = ?
"""
_METRICS = """
    UPDATE job_metrics
    SET llm_calls = llm_calls + ?, input_tokens = input_tokens + ?, output_tokens = output_tokens + ?,
        cost = cost + ?, latency_ms_total = latency_ms_total + ?, latency_ms_max = max(latency_ms_max, ?),
        updated_at = ?
    WHERE job_id = ?
"""


def timestamp(moment: datetime) -> str:
    """A timestamp as SQLAlchemy writes it on SQLite (UTC, naive, with microseconds), so comparisons hold."""
    if moment.tzinfo is not None:
        moment = (moment if moment.utcoffset() == _ZERO else moment.astimezone(UTC)).replace(tzinfo=None)
    return moment.isoformat(" ", "microseconds")


_ZERO = timedelta(0)


def _json(value: Any) -> str:
    return json.dumps(value)  # SQLAlchemy's JSON on SQLite: None is stored as JSON null


def _values(conn: sqlite3.Connection, item_id: int) -> dict[str, Any]:
    return {node_id: json.loads(value) for node_id, value in conn.execute(_VALUES, (item_id,))}


def _claim_quick(conn: sqlite3.Connection, r: ClaimRequest) -> Claim | None:
    """The common claim with its item marked running and its stored values read; None when it does not hold."""
    now = timestamp(r.now)
    params = (r.token, timestamp(r.deadline), now, r.item_id, r.node_id, r.job_id, r.max_attempts)
    row = conn.execute(_CLAIM, params).fetchone()
    if row is None:
        return None
    attempts, status, item_input, custom_id, pipeline_name, pipeline_id, stored = row
    if status == ItemStatus.PENDING:
        conn.execute(_ITEM_RUNNING, (now, r.item_id))
    values = {node_id: json.loads(value) for node_id, value in json.loads(stored).items()}
    item = ClaimedItem(pipeline_name, int(pipeline_id), json.loads(item_input), custom_id, values)
    return Claim(ClaimStatus.CLAIMED, int(attempts), item)


def _claim_all(conn: sqlite3.Connection, requests: Sequence[ClaimRequest]) -> list[Claim | None]:
    return [_claim_quick(conn, r) for r in requests]


def _insert(conn: sqlite3.Connection, value: NodeValue, statement: str) -> tuple[bool, str | None]:
    """The result (``ON CONFLICT DO NOTHING``) and its node marked done: whether this stored it and, when it did,
    the status ``statement`` returns (its job's or its item's)."""
    now = timestamp(value.now)
    params = (value.job_id, value.item_id, value.node_id, _json(value.value), value.duration_ms, value.attempt, now)
    row = conn.execute(statement, params).fetchone()
    conn.execute(_NODE_DONE, (now, value.item_id, value.node_id))
    return (False, None) if row is None else (True, row[0])


def _job_status(conn: sqlite3.Connection, job_id: str) -> str | None:
    row = conn.execute(_JOB_STATUS, (job_id,)).fetchone()
    return None if row is None else str(row[0])


def _store(
    conn: sqlite3.Connection, value: NodeValue, dependents: Sequence[str], deadline: datetime, hold: Hold | None
) -> Stored:
    inserted, status = _insert(conn, value, _INSERT_WITH_JOB)
    if not inserted:
        return Stored(False, [], _job_status(conn, value.job_id))
    if not dependents or status not in _OPEN_JOBS:  # a cancel stops the release in this transaction
        return Stored(True, [], status)
    hold_queue, hold_until = (hold.queue, timestamp(hold.until)) if hold is not None else (None, None)
    params = (hold_queue, hold_until, timestamp(deadline), timestamp(value.now), value.item_id, *dependents)
    rows = [r for r in conn.execute(_release(len(dependents)), params) if r[6] == NodeTaskStatus.QUEUED]
    ready = [NodeTaskRef(r[0], int(r[1]), r[2], int(r[3]), r[4], int(r[5])) for r in rows]
    # the inline ops made ready run at once on the item's stored values: read here, not in a unit of their own
    values = _values(conn, value.item_id) if any(r[7] == INLINE_KIND for r in rows) else None
    return Stored(True, ready, status, values)


def _finish(
    conn: sqlite3.Connection, job_id: str, item_id: int, end: ItemEnd, now: datetime
) -> tuple[JobProgress, str]:
    """Store the outcome of an open item (checked in this transaction), with the job's counters and metrics;
    returns the job's progress and status."""
    at = timestamp(now)
    completed, failed = int(end.status == ItemStatus.COMPLETED), int(end.status == ItemStatus.FAILED)
    seq, *counts, status = conn.execute(_JOB_PROGRESS, (completed, failed, at, job_id)).fetchone()
    conn.execute(_ITEM_DONE, (end.status.value, _json(end.output), _json(end.error), seq, at, item_id))
    m: ItemMetrics = end.metrics
    if m.calls:
        conn.execute(
            _METRICS,
            (m.calls, m.input_tokens, m.output_tokens, m.cost, m.latency_ms_total, m.latency_ms_max, at, job_id),
        )
    return JobProgress(*(int(n) for n in counts)), status


def _item_open(conn: sqlite3.Connection, item_id: int) -> bool:
    row = conn.execute(_ITEM_STATUS, (item_id,)).fetchone()
    return row is not None and row[0] in _OPEN_ITEMS


def _store_last(conn: sqlite3.Connection, value: NodeValue, end: ItemEnd) -> LastStored:
    inserted, item_status = _insert(conn, value, _INSERT_WITH_ITEM)
    if not inserted or item_status not in _OPEN_ITEMS:
        return LastStored(inserted, None, _job_status(conn, value.job_id))
    progress, job_status = _finish(conn, value.job_id, value.item_id, end, value.now)
    return LastStored(True, progress, job_status)


def _finish_if_done(
    conn: sqlite3.Connection, job_id: str, item_id: int, end: ItemEnder, now: datetime
) -> JobProgress | None:
    """Store the outcome of an open item none of whose nodes is unfinished (decided by ``end``); None otherwise."""
    if not _item_open(conn, item_id) or conn.execute(_UNFINISHED_NODES, (item_id,)).fetchone()[0]:
        return None
    return _finish(conn, job_id, item_id, end(partial(_values, conn, item_id)), now)[0]


def _store_sink(conn: sqlite3.Connection, value: NodeValue, end: ItemEnder) -> LastStored:
    inserted, _ = _insert(conn, value, _INSERT_WITH_ITEM)
    progress = _finish_if_done(conn, value.job_id, value.item_id, end, value.now) if inserted else None
    return LastStored(inserted, progress, _job_status(conn, value.job_id))


class SqliteNodeStore(CoreNodeStore):
    """:class:`~app.db.repository.node_store.protocol.NodeStore` with its hot operations on an
    :class:`~app.db.sqlite_writer.SqliteWriter` for the database file ``path``. :meth:`close` stops its writer
    thread (which also stops by itself when idle)."""

    def __init__(self, sessions: sessionmaker[Session], settle: JobSettler, path: Path) -> None:
        super().__init__(sessions, settle)
        self.writer = SqliteWriter(path)

    def close(self) -> None:
        self.writer.close()

    def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self.writer.run(work)

    def claim(self, request: ClaimRequest) -> Claim:
        return self.claim_many([request])[0]

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """The common claims in one unit of work; the others one by one, as the Core store decides them (a
        re-delivery's take-over, a stored or busy node, a closed job)."""
        claims = self._run(partial(_claim_all, requests=requests))
        slow = super().claim  # (zero-argument super() does not work inside a comprehension)
        return [claim or slow(r) for r, claim in zip(requests, claims, strict=True)]

    def renew(self, *, item_id: int, node_id: str, token: str, deadline: datetime) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            at = timestamp(deadline)
            return conn.execute(_RENEW, (at, at, item_id, node_id, token)).rowcount == 1

        return bool(self._run(work))

    def item_values(self, *, item_id: int) -> dict[str, Any]:
        return self._run(partial(_values, item_id=item_id))

    def store(
        self, value: NodeValue, *, dependents: Sequence[str], deadline: datetime, hold: Hold | None = None
    ) -> Stored:
        return self._run(partial(_store, value=value, dependents=dependents, deadline=deadline, hold=hold))

    def store_last(self, value: NodeValue, end: ItemEnd) -> LastStored:
        stored = self._run(partial(_store_last, value=value, end=end))
        if settle_due(stored.inserted, stored.progress, stored.job_status):
            self.settle(job_id=value.job_id)
        return stored

    def store_sink(self, value: NodeValue, end: ItemEnder) -> LastStored:
        stored = self._run(partial(_store_sink, value=value, end=end))
        progress = stored.progress
        if (progress is not None and progress.finished) or stored.job_status == JobStatus.CANCELLING:
            self.settle(job_id=value.job_id)
        return stored

    def finish_item(self, *, job_id: str, item_id: int, end: ItemEnder) -> JobProgress | None:
        now = utcnow()
        progress = self._run(
            partial(_finish_if_done, job_id=job_id, item_id=item_id, end=end, now=now)
        )
        if progress is not None and progress.finished:
            self.settle(job_id=job_id)
        return progress
