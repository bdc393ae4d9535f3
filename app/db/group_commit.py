"""Group commit on raw psycopg connections: the statements that many threads of one process issue at about the
same time run together, in one transaction and one round trip (pipeline mode), instead of one autocommit
transaction each.

A node task's claim and store are one statement each; at hundreds of nodes per second the PostgreSQL server
spends more CPU on the transactions and round trips around them than on the statements, on the same cores as the
worker. Here the first thread to arrive leads: it runs every statement queued meanwhile (up to ``max_batch``) and
commits once; the others wait for that commit, so each caller still returns only once its statement is durable
(as durable as its connection's ``synchronous_commit`` makes any commit). Then the leader hands the lead to the
next waiting thread, if any, and returns.

The statements of a batch must be independent (each correct alone, in any order): they run sorted by their
``key`` so that two processes' batches take row locks in one order. If the batch fails (a deadlock with another
process, a constraint), its transaction rolls back and each statement runs again alone, in its own transaction,
so every caller gets its own result or error. A lost connection fails the whole batch with SQLAlchemy's
``OperationalError`` (``connection_invalidated``), as :class:`~app.db.direct.DirectPool` does for one statement:
callers retry then, and their statements must be idempotent (a commit whose outcome was lost may have happened).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from app.db.direct import DirectPool

__all__ = ["GroupCommit"]

Rows = list[tuple[Any, ...]]


@dataclass(eq=False)
class _Entry:
    sql: str
    params: dict[str, Any]
    key: tuple[Any, ...]
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # set by the previous leader: this thread runs the next batch
    rows: Rows | None = None
    error: BaseException | None = None


class GroupCommit:
    """Runs statements of many threads in shared transactions on ``pool`` (see the module docstring).
    ``statements`` and ``transactions`` count what it sent (read by tests and benchmarks)."""

    def __init__(self, pool: DirectPool, *, max_batch: int = 64, leaders: int = 1) -> None:
        if max_batch < 1 or leaders < 1:
            raise ValueError("max_batch and leaders must be at least 1")
        self._pool = pool
        self._max_batch = max_batch
        self._leaders = leaders  # batches in flight at once: one alone makes every caller wait for the last
        self._lock = threading.Lock()
        self._queue: list[_Entry] = []
        self._leading = 0
        self.statements = 0
        self.transactions = 0

    def execute(self, sql: str, params: dict[str, Any], key: tuple[Any, ...] = ()) -> Rows:
        """The rows of ``sql`` once the transaction that ran it committed (its error if it failed)."""
        entry = _Entry(sql, params, key)
        with self._lock:
            self._queue.append(entry)
            lead = self._leading < self._leaders
            self._leading += lead
        if not lead:
            entry.done.wait()
            lead = entry.lead
        if lead:
            self._lead(entry)
        if entry.error is not None:
            raise entry.error
        assert entry.rows is not None
        return entry.rows

    def _lead(self, entry: _Entry) -> None:
        """Run one batch (``entry``, this thread's, and the oldest queued), then pass the lead on or give it up."""
        with self._lock:
            if entry in self._queue:
                self._queue.remove(entry)
            batch = [entry, *self._queue[: self._max_batch - 1]]
            del self._queue[: self._max_batch - 1]
        try:
            self._run(batch)
        finally:
            for ran in batch:
                if ran.rows is None and ran.error is None:  # a bug below must not leave a caller waiting
                    ran.error = RuntimeError("the batch did not run")
            with self._lock:
                successor = self._queue.pop(0) if self._queue else None
                if successor is None:
                    self._leading -= 1
            if successor is not None:
                successor.lead = True
                successor.done.set()
            for ran in batch:
                ran.done.set()

    def _run(self, batch: Sequence[_Entry]) -> None:
        if len(batch) == 1:
            self._alone(batch[0])
            return
        ordered = sorted(batch, key=lambda e: e.key)
        try:
            with self._pool.connection() as conn:
                try:
                    results = self._together(conn, ordered)
                except psycopg.Error:
                    if conn.broken or conn.closed:
                        raise  # the pool turns it into OperationalError(connection_invalidated)
                    results = None  # rolled back: a deadlock or one statement's error
        except BaseException as exc:
            for entry in batch:
                entry.error = exc
            return
        if results is None:
            for entry in ordered:
                self._alone(entry)
            return
        for entry, rows in zip(ordered, results, strict=True):
            entry.rows = rows

    def _count(self, statements: int) -> None:
        with self._lock:
            self.transactions += 1
            self.statements += statements

    def _together(self, conn: psycopg.Connection, ordered: Sequence[_Entry]) -> list[Rows]:
        """All statements in one transaction, sent in one pipeline (one round trip, one commit)."""
        self._count(len(ordered))
        with conn.pipeline():
            with conn.transaction():
                cursors = [conn.execute(e.sql, e.params, prepare=True) for e in ordered]
            return [cursor.fetchall() if cursor.description is not None else [] for cursor in cursors]

    def _alone(self, entry: _Entry) -> None:
        """One statement in its own (autocommit) transaction."""
        self._count(1)
        try:
            with self._pool.connection() as conn:
                cursor = conn.execute(entry.sql, entry.params, prepare=True)
                entry.rows = cursor.fetchall() if cursor.description is not None else []
        except BaseException as exc:
            entry.error = exc
