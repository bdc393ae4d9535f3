"""Running the Alembic migrations from code (``inf-engine db upgrade``, server start, tests).

The migrations are package data of ``app.db.migrations`` (found through :mod:`importlib.resources`), so they
travel in the wheel and the image and work from any directory. On PostgreSQL every upgrade or downgrade holds a
session-level advisory lock: two processes migrating at once (two API replicas, an init container per pod) run
one after the other, and the second finds the schema at head and does nothing.

``schema_status`` says whether a database is at the head revision, cheaply (the head is read from the scripts
once per process; the database gets one connection with a short timeout): ``/ready`` and ``inf-engine db check``
answer from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from app.db.session import create_db_engine, sqlite_path

#: pg_advisory_lock key of the migrations (any constant 64-bit number; this one spells "infmigr" in ASCII)
MIGRATION_LOCK_KEY = 0x696E666D696772


def migrations_dir() -> Path:
    """The folder of the Alembic environment inside the installed package."""
    folder = Path(str(resources.files("app.db.migrations")))
    if not (folder / "env.py").is_file():
        raise FileNotFoundError(f"the Alembic migrations are missing from the package (looked in {folder})")
    return folder


def alembic_config(url: str, connection: Connection | None = None) -> Config:
    folder = migrations_dir()
    config = Config(str(folder / "alembic.ini"))
    config.set_main_option("script_location", str(folder))
    # '%' is ConfigParser's interpolation character (it appears in URL-encoded passwords)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection  # env.py migrates on it (it holds the lock)
    return config


@contextmanager
def _locked(url: str) -> Iterator[Connection | None]:
    """A connection holding the migrations' advisory lock on PostgreSQL; None elsewhere (SQLite has one writer)."""
    engine = create_db_engine(url)
    try:
        if engine.dialect.name != "postgresql":
            yield None
            return
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            connection.commit()  # a session-level lock: it outlives this transaction
            try:
                yield connection
            finally:
                connection.rollback()
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                connection.commit()
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    with _locked(url) as connection:
        command.upgrade(alembic_config(url, connection), revision)


def downgrade(url: str, revision: str = "-1") -> None:
    with _locked(url) as connection:
        command.downgrade(alembic_config(url, connection), revision)


def current_revision(url: str | None = None, engine: Engine | None = None) -> str | None:
    engine = engine or create_db_engine(url or "")
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision(url: str = "") -> str | None:
    """The newest revision of the installed migrations (read once per process: the scripts do not change)."""
    return _scripts()[0]


@functools.cache
def _scripts() -> tuple[str | None, frozenset[str]]:
    """(head, every revision) of the installed migrations."""
    folder = migrations_dir()
    config = Config(str(folder / "alembic.ini"))
    config.set_main_option("script_location", str(folder))
    scripts = ScriptDirectory.from_config(config)
    return scripts.get_current_head(), frozenset(s.revision for s in scripts.walk_revisions())


# -- is a database at head? (readiness) --------------------------------------------------------------------------------
#: seconds a readiness check waits for the database (connect, then the one query)
CHECK_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SchemaStatus:
    """A database's schema against the installed migrations; ``problem`` says in one line why it is not ready."""

    current: str | None  # None: no revision (an empty database, or an SQLite file not created yet)
    head: str | None
    error: str | None = None  # the database could not be read: why, in one line
    known: bool = True  # ``current`` is one of the installed migrations' revisions

    @property
    def at_head(self) -> bool:
        return self.error is None and self.current == self.head

    @property
    def code(self) -> str | None:
        """``database_unreachable``, ``schema_not_at_head``, or None when at head."""
        if self.error is not None:
            return "database_unreachable"
        return None if self.at_head else "schema_not_at_head"

    @property
    def problem(self) -> str | None:
        if self.error is not None:
            return f"the database is unreachable: {self.error}"
        if self.at_head:
            return None
        if not self.known:
            return (f"the database schema is at revision {self.current}, which this inf-engine's migrations do not "
                    f"know (their head is {self.head}): a newer inf-engine migrated it")
        return (f"the database schema is at revision {self.current or 'base (empty)'}, not at head {self.head}: "
                "run `inf-engine db upgrade`")

    def as_dict(self) -> dict[str, Any]:
        return {"revision": self.current, "head": self.head, "at_head": self.at_head}


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "orig", None) or exc  # the driver's own message, without SQLAlchemy's wrapping
    lines = str(cause).strip().splitlines()
    return lines[0].strip() if lines else type(cause).__name__


@functools.lru_cache(maxsize=8)
def _check_engine(url: str, timeout_s: float) -> Engine:
    """An engine per URL for the checks: no pool (a check holds no connection between calls), a short timeout."""
    if make_url(url).get_backend_name() == "sqlite":
        return create_db_engine(url, poolclass=NullPool, connect_args={"timeout": timeout_s, "check_same_thread": False})
    # libpq's connect_timeout is whole seconds, at least 2
    return create_db_engine(url, poolclass=NullPool, connect_args={"connect_timeout": max(2, math.ceil(timeout_s))})


def schema_status(url: str, *, timeout_s: float = CHECK_TIMEOUT_S) -> SchemaStatus:
    """Whether the database at ``url`` is at the installed migrations' head: one connection, one short query.
    A missing SQLite file is an empty database (the check does not create it)."""
    head, known = _scripts()
    path = sqlite_path(url)
    if path is not None and not path.exists():
        return SchemaStatus(current=None, head=head)
    try:
        engine = _check_engine(url, timeout_s)
        with engine.connect() as connection:
            if engine.dialect.name == "postgresql":  # bounds the query too, within this transaction only
                connection.execute(text(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}"))
            current = MigrationContext.configure(connection).get_current_revision()
    except Exception as exc:
        return SchemaStatus(current=None, head=head, error=_first_line(exc))
    return SchemaStatus(current=current, head=head, known=current is None or current in known)
