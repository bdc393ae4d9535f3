"""Group commit on raw psycopg connections: the statements that many threads of one process issue at about the
same time run together, in one transaction and one round trip (pipeline mode), instead of one autocommit
transaction each.

A node task's claim and store are one statement each; at hundreds of nodes per second the PostgreSQL server
spends more CPU on the transactions and round trips around them than on the statements, on the same cores as the
worker. Here callers queue their statement and wait; one committer thread per :class:`GroupCommit` takes
everything queued (up to ``max_batch``), runs it in one transaction, wakes those callers and at once takes the
next batch. Each caller still returns only once its own statement is durable (as durable as its connection's
``synchronous_commit`` makes any commit). A dedicated thread, rather than a caller leading the batch and handing
the lead to the next caller, because a hand-off costs the next caller's wake-up and a turn on the GIL, which the
task threads contend for: the batches then went out tens of milliseconds apart.

The statements of a batch must be independent (each correct alone, in any order): they run sorted by their
``key`` so that two processes' batches take row locks in one order. If the batch fails (a deadlock with another
process, a constraint), its transaction rolls back and each statement runs again alone, in its own transaction,
so every caller gets its own result or error. A lost connection fails the whole batch with SQLAlchemy's
``OperationalError`` (``connection_invalidated``), as :class:`~app.db.direct.DirectPool` does for one statement:
callers retry then, and their statements must be idempotent (a commit whose outcome was lost may have happened).

The committer starts with the first statement and stops after ``idle_s`` without any (the next statement starts
another), or at :meth:`GroupCommit.close`, which runs what is queued first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from app.db.batch_thread import BatchThread, held_lock
from app.db.direct import DirectPool

__all__ = ["GroupCommit", "retired_committer_cpu_s"]

# CPU seconds of committer threads that have stopped (idle or closed): a process's committer CPU is this plus
# that of the live ones, so a benchmark's before/after snapshots stay right when a committer idles out between.
_retired = {"cpu_s": 0.0}
_retired_lock = threading.Lock()


def retired_committer_cpu_s() -> float:
    with _retired_lock:
        return _retired["cpu_s"]

Rows = list[tuple[Any, ...]]


@dataclass(eq=False)
class _Entry:
    sql: str
    params: dict[str, Any]
    key: tuple[Any, ...]
    done: threading.Lock = field(default_factory=held_lock)  # held until the committer is done with it
    rows: Rows | None = None
    error: BaseException | None = None


class GroupCommit(BatchThread[_Entry]):
    """Runs statements of many threads in shared transactions on ``pool``, from one committer thread (see the
    module docstring). ``statements`` and ``transactions`` count what it sent (read by tests and benchmarks)."""

    thread_name = "group-commit"
    closed_message = "group commit is closed"

    def __init__(self, pool: DirectPool, *, max_batch: int = 64, idle_s: float = 5.0) -> None:
        super().__init__(max_batch=max_batch, idle_s=idle_s)
        self._pool = pool
        self.statements = 0
        self.transactions = 0

    def execute(self, sql: str, params: dict[str, Any], key: tuple[Any, ...] = ()) -> Rows:
        """The rows of ``sql`` once the transaction that ran it committed (its error if it failed)."""
        rows = self._submit(_Entry(sql, params, key)).rows
        assert rows is not None
        return rows

    def _loop(self) -> None:
        try:
            self._commit_batches()
        finally:
            with _retired_lock:
                _retired["cpu_s"] += time.thread_time()

    def _commit_batches(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            except BaseException as exc:  # a bug below must neither leave a caller waiting nor stop the loop
                for entry in batch:
                    if entry.rows is None and entry.error is None:
                        entry.error = exc
            finally:
                for entry in batch:
                    if entry.rows is None and entry.error is None:
                        entry.error = RuntimeError("the batch did not run")
                    entry.done.release()

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
        # only the committer writes these (one at a time: a new one starts once the last has stopped taking work)
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
