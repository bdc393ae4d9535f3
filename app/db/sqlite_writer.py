"""Group commit on one raw sqlite3 connection: the writes that many threads of one process issue at about the
same time run together, in one transaction, from one writer thread (SQLite only).

SQLite has one writer at a time. When every task thread of the embedded mode writes its node claims and stores
in a transaction of its own, they queue on the database's lock, whose busy handler sleeps for milliseconds
between tries, and each pays a ``BEGIN IMMEDIATE`` and a commit (a WAL append of every page it touched). Here
callers queue a unit of work (a function of the connection) and wait; the writer takes everything queued (up to
``max_batch``), runs it in one transaction, commits, wakes those callers and takes the next batch, as
:class:`app.db.group_commit.GroupCommit` does for PostgreSQL. Each caller returns only once its own work is
committed (as durable as ``synchronous=NORMAL`` makes any commit: a power loss may forget the last ones, which
the node leases and attempts handle as a worker that died mid-node). Its transactions take the file's write lock
(:mod:`app.db.sqlite_lock`) as every engine of this process does, so they queue with the others in order.

Units of work must be independent (each correct alone, in any order) and must not keep state of their own
between runs: if one raises, the batch rolls back and each unit runs again alone, in its own transaction, so
every caller gets its own result or error. sqlite3's errors reach callers as SQLAlchemy's (``OperationalError``
for a locked or unreachable database), so they keep one rule for "the database is unavailable": retry later.

The writer starts with the first unit and stops after ``idle_s`` without any (the next unit starts another, on a
new connection), or at :meth:`SqliteWriter.close`, which runs what is queued first.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import DBAPIError, StatementError

from app.db.batch_thread import BatchThread, held_lock
from app.db.session import sqlite_connect
from app.db.sqlite_lock import BUSY_TIMEOUT_S, write_lock

__all__ = ["SqliteWriter", "Work"]

T = TypeVar("T")

#: a unit of work: runs its statements on the writer's connection, inside the batch's transaction
Work = Callable[[sqlite3.Connection], T]

@dataclass(eq=False)
class _Entry(Generic[T]):
    work: Work[T]
    done: threading.Lock = field(default_factory=held_lock)  # held until the writer is done with it
    ran: bool = False
    result: Any = None
    error: BaseException | None = None


def as_sqlalchemy(exc: sqlite3.Error) -> StatementError:
    """sqlite3's error as SQLAlchemy's matching one (``OperationalError`` for a locked database)."""
    return DBAPIError.instance(None, None, exc, sqlite3.Error)


class SqliteWriter(BatchThread["_Entry[Any]"]):
    """Runs units of work of many threads in shared transactions on one connection to ``path`` (see the module
    docstring). ``units`` and ``transactions`` count what it ran (read by tests and benchmarks)."""

    thread_name = "sqlite-writer"
    closed_message = "the SQLite writer is closed"

    def __init__(self, path: Path, *, max_batch: int = 64, idle_s: float = 5.0) -> None:
        super().__init__(max_batch=max_batch, idle_s=idle_s)
        self._path = path
        self.units = 0
        self.transactions = 0
        self._lock = write_lock(path)

    def run(self, work: Work[T]) -> T:
        """``work``'s result once the transaction that ran it committed (its error if it failed)."""
        entry: _Entry[T] = self._submit(_Entry(work))
        return entry.result  # type: ignore[no-any-return]

    def _loop(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while (batch := self._next_batch()) is not None:
                try:
                    if conn is None:
                        conn = sqlite_connect(self._path)
                    self._run(conn, batch)
                except BaseException as exc:  # no connection, a lock held past the timeout, or a bug below
                    for entry in batch:
                        if not entry.ran and entry.error is None:
                            entry.error = as_sqlalchemy(exc) if isinstance(exc, sqlite3.Error) else exc
                    if conn is not None:  # its state is unknown: the next batch starts on a new one
                        conn.close()
                        conn = None
                finally:
                    for entry in batch:
                        entry.done.release()
        finally:
            if conn is not None:
                conn.close()

    @contextmanager
    def _transaction(self, conn: sqlite3.Connection) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` under the file's write lock, committed when the block ends, rolled back if it
        raises. The lock waits first; past the busy timeout the ``BEGIN`` raises, as any writer's would."""
        held = self._lock.acquire(timeout=BUSY_TIMEOUT_S)
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            if held:
                self._lock.release()

    def _run(self, conn: sqlite3.Connection, batch: Sequence[_Entry[Any]]) -> None:
        if len(batch) == 1:
            self._alone(conn, batch[0])
            return
        self.transactions += 1
        self.units += len(batch)
        try:
            with self._transaction(conn):
                results = [entry.work(conn) for entry in batch]
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):  # busy past the timeout: every unit of the batch gets the error
                raise
            results = None
        except Exception:
            results = None
        if results is None:  # one unit's error: each runs again alone, and gets its own outcome
            for entry in batch:
                self._alone(conn, entry)
            return
        for entry, result in zip(batch, results, strict=True):
            entry.result, entry.ran = result, True

    def _alone(self, conn: sqlite3.Connection, entry: _Entry[Any]) -> None:
        """One unit in its own transaction."""
        self.transactions += 1
        self.units += 1
        try:
            with self._transaction(conn):
                entry.result = entry.work(conn)
            entry.ran = True
        except sqlite3.Error as exc:
            entry.error = as_sqlalchemy(exc)
        except Exception as exc:
            entry.error = exc
