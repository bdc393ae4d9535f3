"""Persistence of the job platform: SQLAlchemy models, engines/sessions, repository functions, migrations."""

from app.db import optimization_models  # noqa: F401  (registers the training and evaluation tables)
from app.db.base import Base, to_unix, utcnow
from app.db.models import (
    BATCH_FINAL,
    ITEM_OPEN,
    JOB_TERMINAL,
    Batch,
    BatchStatus,
    File,
    GraphNode,
    Item,
    ItemStatus,
    Job,
    JobMetrics,
    JobStatus,
    NodeResult,
    ParameterVersion,
    Pipeline,
)
from app.db.session import (
    DATABASE_UNAVAILABLE,
    Session,
    SessionFactory,
    create_db_engine,
    database_url,
    make_session_factory,
    session_scope,
)

__all__ = [
    "BATCH_FINAL",
    "DATABASE_UNAVAILABLE",
    "ITEM_OPEN",
    "JOB_TERMINAL",
    "Base",
    "Batch",
    "BatchStatus",
    "File",
    "GraphNode",
    "Item",
    "ItemStatus",
    "Job",
    "JobMetrics",
    "JobStatus",
    "NodeResult",
    "ParameterVersion",
    "Pipeline",
    "Session",
    "SessionFactory",
    "create_db_engine",
    "database_url",
    "make_session_factory",
    "session_scope",
    "to_unix",
    "utcnow",
]
