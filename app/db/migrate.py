"""Running the Alembic migrations from code (``inf-engine db upgrade``, server start, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

from app.db.session import create_db_engine

#: migrations/ sits at the repository root, beside the app package
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"the Alembic migrations are not at {MIGRATIONS_DIR}; run inf-engine from a checkout of the repository"
        )
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # '%' is ConfigParser's interpolation character (it appears in URL-encoded passwords)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "-1") -> None:
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str | None = None, engine: Engine | None = None) -> str | None:
    engine = engine or create_db_engine(url or "")
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision(url: str) -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()
