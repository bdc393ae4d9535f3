"""Running the Alembic migrations from code (``inf-engine db upgrade``, server start, tests).

The migrations are package data of ``app.db.migrations`` (found through :mod:`importlib.resources`), so they
travel in the wheel and the image and work from any directory. On PostgreSQL every upgrade or downgrade holds a
session-level advisory lock: two processes migrating at once (two API replicas, an init container per pod) run
one after the other, and the second finds the schema at head and does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, text

from app.db.session import create_db_engine

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


def head_revision(url: str) -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()
