"""Engines and sessions from ``Settings.database_url`` (an SQLite file in ``Settings.data_dir`` when unset)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.db.sqlite_lock import BUSY_TIMEOUT_S, install_write_lock
from app.settings import Settings

SQLITE_FILE = "inf-engine.db"

#: the database unreachable (a restart, a failover): callers outside app.db retry on these without naming SQLAlchemy
DATABASE_UNAVAILABLE: tuple[type[Exception], ...] = (OperationalError, InterfaceError)

#: what makes sessions (callers outside app.db name the type without importing SQLAlchemy)
SessionFactory = sessionmaker[Session]


def database_url(settings: Settings) -> str:
    """The configured URL; ``postgresql://`` is given the psycopg 3 driver, which is the one installed."""
    if settings.database_url:
        url = settings.database_url
        if url.startswith("postgres://"):
            url = "postgresql://" + url[len("postgres://") :]
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url[len("postgresql://") :]
        if settings.database_password:  # one secret per value: the password is not repeated inside the URL
            url = make_url(url).set(password=settings.database_password).render_as_string(hide_password=False)
        return url
    return f"sqlite:///{Path(settings.data_dir).expanduser().resolve() / SQLITE_FILE}"


def sqlite_path(url: str) -> Path | None:
    """The database file of an SQLite URL (None for other databases and in-memory SQLite)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def create_db_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``. SQLite gets WAL (readers do not block the writer), a busy timeout (server threads
    and the executor write concurrently), enforced foreign keys and, on a file, the process's write lock of that
    file (:mod:`app.db.sqlite_lock`: this process's writers queue in order instead of polling the database)."""
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"timeout": BUSY_TIMEOUT_S, "check_same_thread": False})
    else:
        kwargs.setdefault("pool_pre_ping", True)
    engine = create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
        if path is not None:  # this process's transactions on the file queue on its write lock
            timeout = float(kwargs.get("connect_args", {}).get("timeout", BUSY_TIMEOUT_S))
            install_write_lock(engine, path, timeout=timeout)
        else:
            event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # the driver's own implicit BEGIN is switched off; transactions take the write lock up front instead
    # (BEGIN IMMEDIATE), so that two writers queue rather than failing to upgrade a read snapshot
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    cursor.close()


def sqlite_connect(path: Path) -> sqlite3.Connection:
    """A raw connection to the SQLite file ``path`` set up as the engines' are (WAL, busy timeout, foreign keys,
    transactions begun explicitly): for the SQLite node store's writer thread."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    _sqlite_pragmas(conn, None)
    return conn


def _sqlite_begin(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # objects stay readable after commit: services return them to routes that shape the answer
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: committed when the block ends, rolled back when it raises."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
