"""The declarative base: one MetaData with a naming convention, so Alembic names constraints the same way
on PostgreSQL and SQLite (and downgrades can drop them by name)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Integer, MetaData
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: JSON documents: JSONB on PostgreSQL (compact, indexable), plain JSON text elsewhere
JSONDoc = JSON().with_variant(JSONB(), "postgresql")

#: 64-bit ids on PostgreSQL; SQLite only auto-increments a column declared exactly INTEGER
BigId = BigInteger().with_variant(Integer(), "sqlite")

#: timestamps are stored in UTC
Timestamp = DateTime(timezone=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: dict[Any, Any] = {dict[str, Any]: JSONDoc, datetime: Timestamp}


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_unix(moment: datetime | None) -> int | None:
    """Seconds since the epoch (SQLite hands back naive datetimes: they are UTC)."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp())
