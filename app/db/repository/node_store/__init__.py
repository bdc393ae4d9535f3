"""The node store: one protocol for every state change of a node task (:mod:`.protocol`), on SQLAlchemy Core
(:mod:`.core`, PostgreSQL and SQLite) or, for the hot path, on raw psycopg connections (:mod:`.psycopg`,
PostgreSQL) or a raw sqlite3 connection (:mod:`.sqlite`, an SQLite file)."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from app.db.direct import DirectPool
from app.db.repository.node_store.core import CoreNodeStore, JobSettler
from app.db.repository.node_store.protocol import (
    Claim,
    ClaimedItem,
    ClaimRequest,
    ClaimStatus,
    Hold,
    ItemEnd,
    ItemEnder,
    ItemMetrics,
    JobProgress,
    LastStored,
    NodeStore,
    NodeValue,
    Stored,
    StoredValues,
    too_many_attempts,
)
from app.db.repository.node_store.psycopg import PsycopgNodeStore
from app.db.repository.node_store.sqlite import SqliteNodeStore
from app.db.repository.node_tasks import NodeTaskRef
from app.db.session import sqlite_path


def open_node_store(
    sessions: sessionmaker[Session],
    settle: JobSettler,
    direct: DirectPool | None = None,
    *,
    group_commit: bool = True,
) -> NodeStore:
    """The store a worker uses: on ``direct`` (raw autocommit connections to PostgreSQL) when it has them, on
    an SQLite file's writer thread (raw sqlite3) when ``sessions`` are on one, otherwise on ``sessions``.
    ``settle`` makes a job terminal when it is due (in the given transaction); ``group_commit``: the task
    threads' claims and stores share transactions (on SQLite they always do: it has one writer)."""
    if direct is not None:
        return PsycopgNodeStore(sessions, settle, direct, group_commit=group_commit)
    bind = sessions.kw.get("bind")
    path = sqlite_path(bind.url.render_as_string(hide_password=False)) if bind is not None else None
    if path is not None:
        return SqliteNodeStore(sessions, settle, path)
    return CoreNodeStore(sessions, settle)


__all__ = [
    "Claim",
    "ClaimRequest",
    "ClaimStatus",
    "ClaimedItem",
    "CoreNodeStore",
    "Hold",
    "ItemEnd",
    "ItemEnder",
    "ItemMetrics",
    "JobProgress",
    "JobSettler",
    "LastStored",
    "NodeStore",
    "NodeTaskRef",
    "NodeValue",
    "PsycopgNodeStore",
    "SqliteNodeStore",
    "Stored",
    "StoredValues",
    "open_node_store",
    "too_many_attempts",
]
