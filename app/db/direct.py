"""Raw psycopg connections for the node task's hot path (PostgreSQL only).

A node task runs two statements (claim, store) at hundreds of tasks per second. Through a SQLAlchemy session each
costs about 280 us of CPU (session, pool checkout, pre-ping, compiled-statement lookups) against about 65 us for
a prepared statement on a raw psycopg connection, and the worker process is CPU-bound on its GIL, so the hot
statements run here: autocommit, so that each is its own transaction and one round trip.

A connection that fails with a connection-level error is dropped and the error is re-raised as SQLAlchemy's
``OperationalError`` (``connection_invalidated``), so callers keep one rule for "the database is unreachable":
retry later (a PostgreSQL restart mid-job).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError


def psycopg_conninfo(url: str) -> str:
    """A libpq URL for a SQLAlchemy PostgreSQL URL (``postgresql+psycopg://...`` -> ``postgresql://...``)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"direct connections need PostgreSQL, not {parsed.get_backend_name()!r}")
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class DirectPool:
    """At most ``size`` autocommit psycopg connections, opened on demand and shared by the task threads of one
    worker process; a thread waits while all are in use. ``options`` go to the server (``-c name=value``)."""

    def __init__(self, url: str, *, size: int = 16, options: str | None = None, connect_timeout: int = 10) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self._conninfo = psycopg_conninfo(url)
        self._options = options
        self._connect_timeout = connect_timeout
        self._idle: list[psycopg.Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False

    def _open(self) -> psycopg.Connection:
        kwargs: dict[str, object] = {"autocommit": True, "connect_timeout": self._connect_timeout}
        if self._options:
            kwargs["options"] = self._options
        try:
            return psycopg.connect(self._conninfo, **kwargs)  # type: ignore[arg-type]
        except psycopg.OperationalError as exc:
            raise OperationalError("connect", None, exc, connection_invalidated=True) from exc

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A connection for a few statements; given back afterwards, or dropped if it broke."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        self._slots.acquire()
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                conn = self._open()
            try:
                yield conn
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                conn.close()
                raise OperationalError("direct statement", None, exc, connection_invalidated=True) from exc
            except BaseException:
                # autocommit: no transaction is left open; a broken connection is dropped, a sound one kept
                if not conn.broken and not conn.closed:
                    self._give_back(conn)
                raise
            else:
                self._give_back(conn)
        finally:
            self._slots.release()

    def _give_back(self, conn: psycopg.Connection) -> None:
        if self._closed or conn.closed:
            conn.close()
            return
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
