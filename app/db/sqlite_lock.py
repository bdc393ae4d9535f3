"""One write lock per SQLite file and process, taken with SQLite's own (``BEGIN IMMEDIATE`` to commit or rollback)
by every engine of :mod:`app.db.session` and by :class:`app.db.sqlite_writer.SqliteWriter`.

SQLite has one writer at a time, and a connection that finds the database locked retries on its busy handler,
which sleeps 1, 2, 5, 10, ... up to 100 ms between tries: under load (the embedded mode's node stores, the
dispatch windows' refills, the API's reads, all in one process) a transaction waited tens of milliseconds after
the lock was free. Threads of this process queue on this lock instead, first come first served, and each is
handed the lock the moment the previous transaction ends; the busy handler remains for other processes.

A thread that waits longer than the busy timeout goes on to ``BEGIN IMMEDIATE`` without the lock, which then
fails (or succeeds) as it did before this lock: a stuck holder turns into "database is locked", not a hang.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import deque
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event

__all__ = ["FairLock", "install_write_lock", "write_lock"]

BUSY_TIMEOUT_S = 30.0  # as the connections' busy timeout
_HELD = "sqlite_write_lock"  # key of a connection's held lock in its pool record's info


class FairLock:
    """A lock handed to its waiters in the order they came (a plain lock lets a thread that releases it and asks
    again at once, like a writer thread, starve the others). Any thread may release it."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: deque[threading.Lock] = deque()
        self._held = False

    def acquire(self, timeout: float = -1) -> bool:
        with self._mutex:
            if not self._held:
                self._held = True
                return True
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        if turn.acquire(timeout=timeout):
            return True  # handed over by release(): held now
        with self._mutex:
            if turn in self._waiters:
                self._waiters.remove(turn)
                return False
        turn.acquire()  # handed over just as the wait timed out: it is ours
        return True

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # still held, by the next waiter now
            else:
                self._held = False

    @property
    def locked(self) -> bool:
        return self._held


_locks: dict[Path, FairLock] = {}
_locks_guard = threading.Lock()


def write_lock(path: Path) -> FairLock:
    """This process's write lock of the database file ``path``."""
    key = path.resolve()
    with _locks_guard:
        lock = _locks.get(key)
        if lock is None:
            lock = _locks[key] = FairLock()
        return lock


def install_write_lock(engine: Engine, path: Path, *, timeout: float = BUSY_TIMEOUT_S) -> None:
    """Every transaction of ``engine`` (on the SQLite file ``path``) begins with ``BEGIN IMMEDIATE`` under the
    file's write lock, which its commit or rollback releases once SQLite has ended the transaction. ``timeout``:
    how long a transaction waits for the lock (the connections' busy timeout) before it tries SQLite anyway."""
    lock = write_lock(path)

    def begin(conn: Any) -> None:
        held = lock.acquire(timeout=timeout)
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            if held:
                lock.release()
            raise
        if held:
            conn.info[_HELD] = lock

    def end(statement: str, conn: Any) -> None:
        # SQLAlchemy's events come before its own COMMIT or ROLLBACK: end the transaction here, so that the next
        # holder does not find the database still locked; SQLAlchemy's own call then finds none open (a no-op)
        held = conn.info.pop(_HELD, None)
        if held is None:
            return
        try:
            dbapi = conn.connection.dbapi_connection
            if dbapi is not None and dbapi.in_transaction:
                dbapi.execute(statement)
        except sqlite3.Error:
            pass  # the transaction is still open: SQLAlchemy's own call tries again and reports the error
        finally:
            held.release()

    def forget(record: Any) -> None:
        # the pool rolls back, closes or drops a connection that still held the lock (an error mid-transaction)
        held = record.info.pop(_HELD, None) if record is not None else None
        if held is not None:
            held.release()

    def on_reset(_dbapi: Any, record: Any, _state: Any) -> None:
        forget(record)

    def on_invalidate(_dbapi: Any, record: Any, _exc: Any) -> None:
        forget(record)

    def on_close_or_checkin(_dbapi: Any, record: Any) -> None:
        forget(record)

    event.listen(engine, "begin", begin)
    event.listen(engine, "commit", lambda conn: end("COMMIT", conn))
    event.listen(engine, "rollback", lambda conn: end("ROLLBACK", conn))
    event.listen(engine.pool, "reset", on_reset)
    event.listen(engine.pool, "invalidate", on_invalidate)
    event.listen(engine.pool, "close", on_close_or_checkin)
    event.listen(engine.pool, "checkin", on_close_or_checkin)
