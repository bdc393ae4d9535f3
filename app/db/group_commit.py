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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

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


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(eq=False)
class _Entry:
    sql: str
    params: dict[str, Any]
    key: tuple[Any, ...]
    # held until the committer is done with the entry: a bare lock, cheaper than an Event (which wraps a
    # Condition and its own lock) to create, wait on and set, per statement
    done: threading.Lock = field(default_factory=_held_lock)
    rows: Rows | None = None
    error: BaseException | None = None


class GroupCommit:
    """Runs statements of many threads in shared transactions on ``pool``, from one committer thread (see the
    module docstring). ``statements`` and ``transactions`` count what it sent (read by tests and benchmarks)."""

    def __init__(self, pool: DirectPool, *, max_batch: int = 64, idle_s: float = 5.0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if idle_s < 0:
            raise ValueError("idle_s must not be negative")
        self._pool = pool
        self._max_batch = max_batch
        self._idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: deque[_Entry] = deque()
        self._committer: threading.Thread | None = None  # running, or None: the next statement starts one
        self._last: threading.Thread | None = None  # joined by close() even if it stopped idle meanwhile
        self._closed = False
        self.statements = 0
        self.transactions = 0

    @property
    def queued(self) -> int:
        """Statements waiting for the next batch (not those of the batch in flight)."""
        with self._cond:
            return len(self._queue)

    def execute(self, sql: str, params: dict[str, Any], key: tuple[Any, ...] = ()) -> Rows:
        """The rows of ``sql`` once the transaction that ran it committed (its error if it failed)."""
        entry = _Entry(sql, params, key)
        with self._cond:
            if self._closed:
                raise RuntimeError("group commit is closed")
            self._queue.append(entry)
            if self._committer is None:
                self._committer = self._last = threading.Thread(
                    target=self._commit_loop, name="group-commit", daemon=True
                )
                self._committer.start()
            else:
                self._cond.notify()
        entry.done.acquire()
        if entry.error is not None:
            raise entry.error
        assert entry.rows is not None
        return entry.rows

    def close(self) -> None:
        """Run what is queued, stop the committer and wait for it; later statements raise RuntimeError."""
        with self._cond:
            self._closed = True
            thread = self._last
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _next_batch(self) -> list[_Entry] | None:
        """The oldest queued statements (up to ``max_batch``), once there are any; None: stop (closed or idle)."""
        with self._cond:
            while not self._queue:
                if self._closed or (not self._cond.wait(self._idle_s) and not self._queue):
                    self._committer = None
                    return None
            return [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]

    def _commit_loop(self) -> None:
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
