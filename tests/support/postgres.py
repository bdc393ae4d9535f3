"""Throw-away PostgreSQL databases for tests: one uniquely named database, dropped again at the end.

Fixtures (import them into a conftest): ``pg_url`` (a migrated database for the test session), ``pg_engine``,
``db`` (a session rolled back after the test) and ``committed`` (tables emptied after the test).

The server is the one CI starts (127.0.0.1:5432, trust auth); ``INF_ENGINE_TEST_POSTGRES`` may name another
(a URL without a database name, e.g. ``postgresql://postgres@127.0.0.1:5432``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from app.db import create_db_engine
from app.db.migrate import upgrade

SERVER = os.environ.get("INF_ENGINE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")


def _admin() -> psycopg.Connection:
    try:
        return psycopg.connect(f"{SERVER}/postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        raise RuntimeError(
            f"PostgreSQL is not reachable at {SERVER} ({exc}); start it (.ci/run does) or set "
            "INF_ENGINE_TEST_POSTGRES"
        ) from exc


@contextmanager
def temporary_database(prefix: str = "infe_test") -> Iterator[str]:
    """Create a database with a unique name, yield its SQLAlchemy URL, drop it afterwards."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with _admin() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"{SERVER}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with _admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# -- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with temporary_database("infe_jobs") as url:
        upgrade(url)
        yield url


@pytest.fixture(scope="session")
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = create_db_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def db(pg_engine: Engine) -> Iterator[Session]:
    """A session inside an outer transaction that is rolled back: a test's commits become savepoints."""
    with pg_engine.connect() as connection:
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)
        try:
            yield session
        finally:
            session.close()
            outer.rollback()


@pytest.fixture
def committed(pg_engine: Engine) -> Iterator[Engine]:
    """For tests whose code commits from several threads (the executor): every table is emptied afterwards."""
    yield pg_engine
    from sqlalchemy import text

    from app.db import Base

    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    with pg_engine.begin() as connection:
        connection.execute(text(f"TRUNCATE {tables} CASCADE"))
