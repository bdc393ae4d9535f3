"""The node store: one protocol for every state change of a node task (:mod:`.protocol`), on SQLAlchemy Core
(:mod:`.core`, PostgreSQL and SQLite) or, for the hot path on PostgreSQL, on raw psycopg connections
(:mod:`.psycopg`)."""

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
from app.db.repository.node_tasks import NodeTaskRef


def open_node_store(
    sessions: sessionmaker[Session],
    settle: JobSettler,
    direct: DirectPool | None = None,
    *,
    group_commit: bool = True,
) -> NodeStore:
    """The store a worker uses: on ``direct`` (raw autocommit connections to PostgreSQL) when it has them,
    otherwise on ``sessions``. ``settle`` makes a job terminal when it is due (in the given transaction);
    ``group_commit``: the task threads' claims and stores on ``direct`` share transactions."""
    if direct is not None:
        return PsycopgNodeStore(sessions, settle, direct, group_commit=group_commit)
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
    "Stored",
    "StoredValues",
    "open_node_store",
    "too_many_attempts",
]
