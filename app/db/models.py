"""The tables of the job platform.

pipelines          a pipeline per tenant: import path, latest traced graph (JSON + hash), active parameters
graph_nodes        the nodes of each traced graph of a pipeline (one row per pipeline/graph hash/node)
jobs               one submission: status, priority, counts, a timestamp per transition, idempotency key, owner
items              one input line of a job: unique (job_id, custom_id); input, output or error, status, attempts
node_results       the checkpoints: one completed node of one item (value, duration, attempt), unique per
                   job/item/node, so a resumed or re-delivered node never runs twice
job_metrics        per-job tokens, cost and latency, and the job's Chrome trace
parameter_versions optimisation history of a pipeline's parameters
files              uploaded JSONL files (``POST /v1/jobs`` by file id, and the OpenAI Batch API)
batches            OpenAI Batch API batches: each runs as one job (kind "batch"); its own status, timestamps,
                   validation errors and output/error files
"""

from __future__ import annotations

import builtins
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db.base import Base, BigId, JSONDoc, utcnow


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


JOB_TERMINAL = frozenset({JobStatus.CANCELLED, JobStatus.COMPLETED, JobStatus.FAILED})


class ItemStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


ITEM_OPEN = frozenset({ItemStatus.PENDING, ItemStatus.RUNNING})


class Pipeline(Base):
    """A pipeline as one tenant sees it: each tenant has its own row, so its own active parameters and its own
    parameter versions; every tenant starts from the pipeline's code (the operator's default)."""

    __tablename__ = "pipelines"
    __table_args__ = (UniqueConstraint("owner", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(64), default="anonymous", server_default="anonymous")
    name: Mapped[str] = mapped_column(String(300))
    import_path: Mapped[str] = mapped_column(String(500))
    graph: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)
    graph_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    parameter_state: Mapped[dict[str, Any]] = mapped_column(JSONDoc, default=dict)
    parameter_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class GraphNode(Base):
    __tablename__ = "graph_nodes"
    __table_args__ = (UniqueConstraint("pipeline_id", "graph_hash", "node_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id", ondelete="CASCADE"))
    graph_hash: Mapped[str] = mapped_column(String(64))
    node_id: Mapped[str] = mapped_column(String(300))
    kind: Mapped[str] = mapped_column(String(16))  # input, op, llm, module
    type: Mapped[str | None] = mapped_column(String(500), nullable=True)
    module_path: Mapped[str] = mapped_column(String(500), default="")
    alias: Mapped[str | None] = mapped_column(String(200), nullable=True)
    dependencies: Mapped[list[str]] = mapped_column(JSONDoc, default=list)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    depth: Mapped[int] = mapped_column(Integer, default=0)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key"),
        Index("ix_jobs_status_priority_id", "status", "priority", "id"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default="pipeline")  # "pipeline", or "batch" (OpenAI Batch API)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id"))
    pipeline_name: Mapped[str] = mapped_column(String(300))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONDoc, default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)  # what the idempotency key named
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    input_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    total_items: Mapped[int] = mapped_column(Integer, default=0)
    completed_items: Mapped[int] = mapped_column(Integer, default=0)
    failed_items: Mapped[int] = mapped_column(Integer, default=0)
    cancelled_items: Mapped[int] = mapped_column(Integer, default=0)
    results_seq: Mapped[int] = mapped_column(Integer, default=0)  # items finished so far, in completion order
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Item(Base):
    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint("job_id", "custom_id"),
        Index("ix_items_job_id_status_position", "job_id", "status", "position"),
        Index("ix_items_job_id_result_seq", "job_id", "result_seq"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    custom_id: Mapped[str] = mapped_column(String(255))
    position: Mapped[int] = mapped_column(Integer)  # order of the input
    input: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # {"args": [...], "kwargs": {...}} (graph JSON encoding)
    output: Mapped[Any] = mapped_column(JSONDoc, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default=ItemStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    graph_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    result_seq: Mapped[int | None] = mapped_column(Integer, nullable=True)  # 1-based position in completion order
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class NodeResult(Base):
    __tablename__ = "node_results"
    __table_args__ = (UniqueConstraint("job_id", "item_id", "node_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    item_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("items.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(String(300))
    value: Mapped[Any] = mapped_column(JSONDoc)  # the node's Value in the graph JSON encoding
    duration_ms: Mapped[float] = mapped_column(Float, default=0.0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobMetrics(Base):
    __tablename__ = "job_metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    llm_calls: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost: Mapped[float] = mapped_column(Float, default=0.0)
    latency_ms_total: Mapped[float] = mapped_column(Float, default=0.0)
    latency_ms_max: Mapped[float] = mapped_column(Float, default=0.0)
    trace: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)  # Chrome Trace Event JSON
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ParameterVersion(Base):
    __tablename__ = "parameter_versions"
    __table_args__ = (UniqueConstraint("pipeline_id", "version"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    state: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONDoc, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(BigInteger)
    content: Mapped[builtins.bytes] = mapped_column(LargeBinary)  # 'bytes' is the size column's name
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BatchStatus(StrEnum):
    """OpenAI's batch statuses. Stored: validating until the batch is final, then completed, failed, expired or
    cancelled; in_progress, cancelling and finalizing are read from the batch's job."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


BATCH_FINAL = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_owner_id", "owner", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING)
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)  # {"object": "list", "data"}
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONDoc, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(nullable=True)  # set when the window ran out
    cancelling_at: Mapped[datetime | None] = mapped_column(nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(nullable=True)


class NodeTaskStatus(StrEnum):
    """Where one graph node of one item stands on the distributed path (Celery workers).

    waiting: some dependency is not stored yet; queued: ready to run, its message either sent (``sent_at`` set,
    it counts against its queue's dispatch window) or not yet (``sent_at`` null: the fair dispatcher sends it
    when the window has room); running: a worker claimed it and holds a lease; done: its result is stored;
    failed: it will not run again.
    """

    WAITING = "waiting"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


# the predicates of the partial indexes above, repeated word for word by the queries that use them
UNSENT_SQL = "(status = 'queued' AND sent_at IS NULL)"
IN_FLIGHT_SQL = "(status = 'running' OR (status = 'queued' AND sent_at IS NOT NULL))"


class NodeTask(Base):
    """The dispatch state of one node of one item, when jobs run on Celery workers. PostgreSQL is the truth:
    ``waiting`` counts the dependencies not yet stored (decremented in the transaction that stores one),
    ``attempts`` counts the deliveries that started running it (the cap on re-deliveries), and ``deadline`` is
    when the sweeper steps in (queued and sent: the message should have been picked up; running: the lease ran
    out); for a queued node not sent yet it is the earliest time it may be sent (a retry's backoff), or null."""

    __tablename__ = "node_tasks"
    __table_args__ = (
        UniqueConstraint("item_id", "node_id"),
        Index("ix_node_tasks_job_id_status", "job_id", "status"),
        Index("ix_node_tasks_status_deadline", "status", "deadline"),
        # the fair dispatcher: a job's unsent ready nodes of one queue, most urgent first ...
        Index(
            "ix_node_tasks_unsent",
            "job_id",
            "queue",
            "priority",
            "item_id",
            postgresql_where=text(UNSENT_SQL),
            sqlite_where=text(UNSENT_SQL),
        ),
        # ... and the nodes in flight (sent and not claimed yet, or running), counted against the windows
        Index(
            "ix_node_tasks_in_flight",
            "queue",
            "job_id",
            postgresql_where=text(IN_FLIGHT_SQL),
            sqlite_where=text(IN_FLIGHT_SQL),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    item_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("items.id", ondelete="CASCADE"))
    node_id: Mapped[str] = mapped_column(String(300))
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default=NodeTaskStatus.WAITING)
    waiting: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    queue: Mapped[str] = mapped_column(String(200))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    claimed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)  # task id of the running delivery
    deadline: Mapped[datetime | None] = mapped_column(nullable=True)
    sent_at: Mapped[datetime | None] = mapped_column(nullable=True)  # its message went to the broker
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
