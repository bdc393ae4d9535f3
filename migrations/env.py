"""Alembic environment: the URL and metadata are the app's own (Settings and app.db.models)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from app.db import models  # noqa: F401  (registers the tables on Base.metadata)
from app.db.base import Base
from app.db.session import create_db_engine, database_url
from app.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    # set by app.db.migrate (and tests); otherwise the process settings decide, as they do for the server
    return config.get_main_option("sqlalchemy.url") or database_url(get_settings())


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=_url().startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def _migrate_on(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite alters tables by copying them: batch mode does that for ALTER-style operations
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:  # app.db.migrate passes the connection that holds the migrations' advisory lock
        _migrate_on(given)
        given.commit()
        return
    engine = create_db_engine(_url())
    try:
        with engine.connect() as connection:
            _migrate_on(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
