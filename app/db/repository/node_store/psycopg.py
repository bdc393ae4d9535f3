"""The node store on raw psycopg connections (PostgreSQL only): the hot path of a node task.

The claim, the stores and the read of an item's values are one autocommit statement each on a connection of
:class:`app.db.direct.DirectPool` (its own transaction, one round trip, prepared on each connection: psycopg
prepares a statement run more than a few times). Data-modifying CTEs run exactly once whether or not the final
SELECT reads them. A claim that is not the common one (a queued node of an open job and item) and the rarer
operations go through :class:`~app.db.repository.node_store.core.CoreNodeStore`.

Statuses come from the model's enums, written into the statements once as SQL literals (constants below).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy.orm import Session, sessionmaker

from app.db.direct import DirectPool
from app.db.group_commit import GroupCommit
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
    JobProgress,
    LastStored,
    NodeValue,
    Stored,
)
from app.db.repository.node_tasks import NodeTaskRef


def _literals(*statuses: StrEnum) -> str:
    """``'a', 'b'``: enum values as SQL string literals (they are plain lowercase words)."""
    assert all(s.value.isidentifier() for s in statuses)
    return ", ".join(f"'{s.value}'" for s in statuses)


_WAITING = _literals(NodeTaskStatus.WAITING)
_QUEUED = _literals(NodeTaskStatus.QUEUED)
_RUNNING = _literals(NodeTaskStatus.RUNNING)
_DONE = _literals(NodeTaskStatus.DONE)
_PENDING_ITEM = _literals(ItemStatus.PENDING)
_RUNNING_ITEM = _literals(ItemStatus.RUNNING)
_OPEN_ITEM = _literals(*sorted(ITEM_OPEN))
_OPEN_JOB = _literals(JobStatus.QUEUED, JobStatus.RUNNING)
# a dependent run by the storing delivery itself (see Hold)
_HELD = f"CAST(%(hold_until)s AS timestamptz) IS NOT NULL AND (queue = %(hold)s OR kind = '{INLINE_KIND}')"

_CLAIM = f"""
    WITH claimed AS (
        UPDATE node_tasks AS nt
        SET status = {_RUNNING}, attempts = nt.attempts + 1, claimed_by = %(token)s, deadline = %(deadline)s,
            started_at = %(now)s, updated_at = %(now)s
        FROM jobs AS j, items AS i
        WHERE nt.item_id = %(item)s AND nt.node_id = %(node)s AND nt.status = {_QUEUED} AND nt.attempts < %(cap)s
          AND j.id = nt.job_id AND j.status IN ({_OPEN_JOB})
          AND i.id = nt.item_id AND i.status IN ({_OPEN_ITEM})
        RETURNING nt.attempts, i.status AS item_status, i.input, i.custom_id, j.pipeline_name, j.pipeline_id
    ), started AS (
        UPDATE items SET status = {_RUNNING_ITEM}, started_at = COALESCE(started_at, %(now)s)
        WHERE id = %(item)s AND status = {_PENDING_ITEM} AND EXISTS (SELECT 1 FROM claimed)
    )
    SELECT c.attempts, c.item_status, c.input, c.custom_id, c.pipeline_name, c.pipeline_id,
           (SELECT COALESCE(jsonb_object_agg(r.node_id, r.value), CAST('{{}}' AS jsonb))
            FROM node_results AS r WHERE r.item_id = %(item)s) AS stored
    FROM claimed AS c
"""

# The common claim of several nodes (one delivery's round) at once: the node rows are locked in one order, as
# are the items a claim starts, so two such statements cannot deadlock on each other.
_CLAIM_MANY = f"""
    WITH req AS (
        SELECT * FROM unnest(CAST(%(jobs)s AS varchar[]), CAST(%(items)s AS bigint[]),
                             CAST(%(nodes)s AS varchar[]), CAST(%(tokens)s AS varchar[]))
                      AS r(job_id, item_id, node_id, token)
    ), target AS (
        SELECT nt.id, req.token FROM node_tasks AS nt
        JOIN req ON nt.item_id = req.item_id AND nt.node_id = req.node_id AND nt.job_id = req.job_id
        WHERE nt.status = {_QUEUED} AND nt.attempts < %(cap)s
        ORDER BY nt.item_id, nt.node_id
        FOR UPDATE OF nt
    ), claimed AS (
        UPDATE node_tasks AS nt
        SET status = {_RUNNING}, attempts = nt.attempts + 1, claimed_by = t.token, deadline = %(deadline)s,
            started_at = %(now)s, updated_at = %(now)s
        FROM target AS t, jobs AS j, items AS i
        WHERE nt.id = t.id AND j.id = nt.job_id AND j.status IN ({_OPEN_JOB})
          AND i.id = nt.item_id AND i.status IN ({_OPEN_ITEM})
        RETURNING nt.item_id, nt.node_id, nt.attempts, i.status AS item_status, i.input, i.custom_id,
                  j.pipeline_name, j.pipeline_id
    ), starting AS (
        SELECT id FROM items
        WHERE id IN (SELECT item_id FROM claimed) AND status = {_PENDING_ITEM}
        ORDER BY id
        FOR UPDATE
    ), started AS (
        UPDATE items SET status = {_RUNNING_ITEM}, started_at = COALESCE(started_at, %(now)s)
        WHERE id IN (SELECT id FROM starting)
    )
    SELECT c.item_id, c.node_id, c.attempts, c.item_status, c.input, c.custom_id, c.pipeline_name,
           c.pipeline_id,
           (SELECT COALESCE(jsonb_object_agg(r.node_id, r.value), CAST('{{}}' AS jsonb))
            FROM node_results AS r WHERE r.item_id = c.item_id) AS stored
    FROM claimed AS c
"""

# The start of both stores: insert the result (a re-delivery finds it there already) and mark the node done.
# Each store continues this WITH list; its further steps check EXISTS (SELECT 1 FROM ins), so they happen once.
_STORE_RESULT = f"""
    WITH ins AS (
        INSERT INTO node_results (job_id, item_id, node_id, value, duration_ms, attempt, created_at)
        VALUES (%(job)s, %(item)s, %(node)s, %(value)s, %(duration)s, %(attempt)s, %(now)s)
        ON CONFLICT (job_id, item_id, node_id) DO NOTHING
        RETURNING id
    ), done AS (
        UPDATE node_tasks SET status = {_DONE}, deadline = NULL, finished_at = %(now)s, updated_at = %(now)s
        WHERE item_id = %(item)s AND node_id = %(node)s
    ), """

_STORE = (
    _STORE_RESULT
    + f"""rel AS (
        UPDATE node_tasks
        SET waiting = waiting - 1,
            status = CASE WHEN waiting - 1 <= 0 THEN {_QUEUED} ELSE status END,
            deadline = CASE WHEN waiting - 1 <= 0 AND {_HELD} THEN %(hold_until)s
                            WHEN waiting - 1 <= 0 THEN %(deadline)s ELSE deadline END,
            sent_at = CASE WHEN waiting - 1 <= 0 AND {_HELD} THEN %(now)s ELSE sent_at END,
            updated_at = %(now)s
        WHERE item_id = %(item)s AND node_id = ANY(CAST(%(deps)s AS varchar[])) AND status = {_WAITING}
          AND EXISTS (SELECT 1 FROM ins)
          AND EXISTS (SELECT 1 FROM jobs WHERE id = %(job)s AND status IN ({_OPEN_JOB}))
        RETURNING job_id, item_id, node_id, attempts, queue, priority, status
    )
    SELECT (SELECT count(*) FROM ins), rel.job_id, rel.item_id, rel.node_id, rel.attempts, rel.queue,
           rel.priority, rel.status, (SELECT status FROM jobs WHERE id = %(job)s)
    FROM (SELECT 1) AS one LEFT JOIN rel ON true
"""
)

_STORE_LAST = (
    _STORE_RESULT
    + f"""open_item AS (
        SELECT id FROM items
        WHERE id = %(item)s AND status IN ({_OPEN_ITEM}) AND EXISTS (SELECT 1 FROM ins)
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
    SELECT (SELECT count(*) FROM ins), p.completed_items, p.failed_items, p.cancelled_items, p.total_items,
           (SELECT status FROM jobs WHERE id = %(job)s)
    FROM (SELECT 1) AS one LEFT JOIN progress AS p ON true
"""
)

_ITEM_VALUES = "SELECT node_id, value FROM node_results WHERE item_id = %(item)s"


def _result_params(value: NodeValue) -> dict[str, Any]:
    """The parameters of :data:`_STORE_RESULT`."""
    return {
        "job": value.job_id,
        "item": value.item_id,
        "node": value.node_id,
        "value": Jsonb(value.value),
        "duration": value.duration_ms,
        "attempt": value.attempt,
        "now": value.now,
    }


def _end_params(end: ItemEnd) -> dict[str, Any]:
    """The item's outcome and metrics in :data:`_STORE_LAST`."""
    m = end.metrics
    return {
        "completed": int(end.status == ItemStatus.COMPLETED),
        "failed": int(end.status == ItemStatus.FAILED),
        "status": end.status.value,
        "output": Jsonb(end.output),
        "error": Jsonb(end.error),
        "calls": m.calls,
        "tokens_in": m.input_tokens,
        "tokens_out": m.output_tokens,
        "cost": m.cost,
        "latency": m.latency_ms_total,
        "latency_max": m.latency_ms_max,
    }


class PsycopgNodeStore(CoreNodeStore):
    """:class:`~app.db.repository.node_store.protocol.NodeStore` with its hot operations on ``direct``.

    With ``group_commit``, the claims and stores that the process's task threads issue at about
    the same time share one transaction and round trip (:class:`~app.db.group_commit.GroupCommit`): each caller
    still returns only after its own statement committed, and each statement is correct alone, so the batch
    changes no outcome, only how many transactions the server runs. Claims run first in a batch, then stores,
    then an item's last stores (which lock the job's row), each by item: one lock order for every worker.
    :meth:`close` stops its committer thread (which also stops by itself when idle)."""

    def __init__(
        self, sessions: sessionmaker[Session], settle: JobSettler, direct: DirectPool, *, group_commit: bool = True
    ) -> None:
        super().__init__(sessions, settle)
        self._direct = direct
        self.group = GroupCommit(direct) if group_commit else None

    def close(self) -> None:
        if self.group is not None:
            self.group.close()

    def _rows(self, sql: str, params: dict[str, Any], key: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self.group is not None:
            return self.group.execute(sql, params, key)
        with self._direct.connection() as conn:
            return conn.execute(sql, params, prepare=True).fetchall()

    def claim(self, request: ClaimRequest) -> Claim:
        """The common claim (a queued node of an open job and item below the attempts cap) with its item marked
        running and its stored values read, in one statement; any other case is decided on the locked row."""
        params = {
            "item": request.item_id,
            "node": request.node_id,
            "token": request.token,
            "cap": request.max_attempts,
            "deadline": request.deadline,
            "now": request.now,
        }
        rows = self._rows(_CLAIM, params, (0, request.item_id, request.node_id))
        if not rows:
            return super().claim(request)
        row = rows[0]
        item = ClaimedItem(row[4], int(row[5]), row[2], row[3], dict(row[6] or {}))
        return Claim(ClaimStatus.CLAIMED, int(row[0]), item)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """The common claims of all ``requests`` in one statement; the others one by one, as :meth:`claim`
        decides them (a re-delivery's take-over, a stored or busy node, a closed job)."""
        if len(requests) < 2:
            return [self.claim(r) for r in requests]
        first = requests[0]
        params = {
            "jobs": [r.job_id for r in requests],
            "items": [r.item_id for r in requests],
            "nodes": [r.node_id for r in requests],
            "tokens": [r.token for r in requests],
            "cap": first.max_attempts,
            "deadline": first.deadline,
            "now": first.now,
        }
        rows = self._rows(_CLAIM_MANY, params, (0, min(r.item_id for r in requests), first.node_id))
        claimed: dict[tuple[int, str], Claim | None] = {
            (int(row[0]), row[1]): Claim(
                ClaimStatus.CLAIMED, int(row[2]), ClaimedItem(row[6], int(row[7]), row[4], row[5], dict(row[8] or {}))
            )
            for row in rows
        }
        slow = super().claim  # (zero-argument super() does not work inside a comprehension)
        # pop: a node listed twice is claimed once; its second request gets claim's answer (busy)
        return [claimed.pop((r.item_id, r.node_id), None) or slow(r) for r in requests]

    def item_values(self, *, item_id: int) -> dict[str, Any]:
        # with the claims and stores of the moment (one round trip for all), after the store that asked committed
        return {node_id: value for node_id, value in self._rows(_ITEM_VALUES, {"item": item_id}, (1, item_id, ""))}

    def store(
        self, value: NodeValue, *, dependents: Sequence[str], deadline: datetime, hold: Hold | None = None
    ) -> Stored:
        params = _result_params(value)
        params.update(
            deps=list(dependents),
            deadline=deadline,
            hold=hold.queue if hold is not None else None,
            hold_until=hold.until if hold is not None else None,
        )
        rows = self._rows(_STORE, params, (1, value.item_id, value.node_id))
        inserted = bool(rows and rows[0][0])
        ready = [
            NodeTaskRef(r[1], int(r[2]), r[3], int(r[4]), r[5], int(r[6]))
            for r in rows
            if r[3] is not None and r[7] == NodeTaskStatus.QUEUED
        ]
        return Stored(inserted, ready, rows[0][8] if rows else None)

    def store_last(self, value: NodeValue, end: ItemEnd) -> LastStored:
        params = {**_result_params(value), **_end_params(end)}
        rows = self._rows(_STORE_LAST, params, (2, value.item_id, value.node_id))
        assert rows  # the statement always returns one row
        row = rows[0]
        inserted = bool(row[0])
        progress = None if row[1] is None else JobProgress(int(row[1]), int(row[2]), int(row[3]), int(row[4]))
        if settle_due(inserted, progress, row[5]):
            self.settle(job_id=value.job_id)
        return LastStored(inserted, progress, row[5])
