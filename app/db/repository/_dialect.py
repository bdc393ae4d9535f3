"""Dialect helpers: the INSERT that knows ``ON CONFLICT DO NOTHING`` on both PostgreSQL and SQLite."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def insert_ignoring_conflicts(session: Session, table: Any, index_elements: list[str]) -> Any:
    """``INSERT ... ON CONFLICT (index_elements) DO NOTHING`` for the session's database."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=index_elements)
    if name == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=index_elements)
    raise RuntimeError(f"the job platform supports PostgreSQL and SQLite, not {name}")
