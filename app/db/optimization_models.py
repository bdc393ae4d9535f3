"""The tables of training and evaluation (issue "6/6 Optimization and evaluation").

trainings            one training run of a pipeline: its request (dataset, loss, optimizer), status, progress
training_steps       one optimizer step of a training: batch scores, the ParameterUpdates it made, the version
                     it produced (the parameter versions themselves live in ``parameter_versions``)
evaluations          one scoring of a pipeline on a dataset; a scheduled run names its schedule and fire time,
                     unique together, so a schedule fires each of its times at most once whoever fires it
evaluation_schedules a cron schedule of evaluations, with the regression margin of its time series
feedback_requests    human feedback asked for by a running training, answered over REST
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.db.base import Base, BigId, JSONDoc, utcnow


class RunStatus(StrEnum):
    """The life of a training or an evaluation."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


RUN_TERMINAL = frozenset({RunStatus.CANCELLED, RunStatus.COMPLETED, RunStatus.FAILED})


class Training(Base):
    __tablename__ = "trainings"
    __table_args__ = (Index("ix_trainings_status_id", "status", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id", ondelete="CASCADE"))
    pipeline_name: Mapped[str] = mapped_column(String(300))
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED)
    request: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # dataset, loss, optimizer, epochs, batch_size, seed
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    completed_steps: Mapped[int] = mapped_column(Integer, default=0)
    base_version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the version training started from
    final_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)  # scores per epoch, final state
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)  # renewed while a runner holds it
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class TrainingStepRow(Base):
    __tablename__ = "training_steps"
    __table_args__ = (UniqueConstraint("training_id", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    training_id: Mapped[str] = mapped_column(ForeignKey("trainings.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    batch: Mapped[int] = mapped_column(Integer)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    scores: Mapped[list[Any]] = mapped_column(JSONDoc, default=list)
    updates: Mapped[list[Any]] = mapped_column(JSONDoc, default=list)  # ParameterUpdate.to_dict() of the step
    errors: Mapped[dict[str, Any]] = mapped_column(JSONDoc, default=dict)  # dataset index -> error
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the parameter version it produced
    # the candidates a selection-gated step proposed (Candidate.to_dict()); None for an SFA step
    candidates: Mapped[list[Any] | None] = mapped_column(JSONDoc, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class EvaluationSchedule(Base):
    __tablename__ = "evaluation_schedules"
    __table_args__ = (Index("ix_evaluation_schedules_enabled_next_fire_at", "enabled", "next_fire_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id", ondelete="CASCADE"))
    pipeline_name: Mapped[str] = mapped_column(String(300))
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    request: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # dataset and loss/metric of every run
    cron: Mapped[str] = mapped_column(String(200))
    margin: Mapped[float] = mapped_column(Float, default=0.0)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    next_fire_at: Mapped[datetime] = mapped_column()
    last_fire_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Evaluation(Base):
    __tablename__ = "evaluations"
    __table_args__ = (
        # the idempotency of scheduled runs: one evaluation per (schedule, fire time); NULLs (ad hoc runs)
        # never collide
        UniqueConstraint("schedule_id", "fire_time"),
        Index("ix_evaluations_status_id", "status", "id"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id", ondelete="CASCADE"))
    pipeline_name: Mapped[str] = mapped_column(String(300))
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED)
    request: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    schedule_id: Mapped[str | None] = mapped_column(
        ForeignKey("evaluation_schedules.id", ondelete="CASCADE"), nullable=True
    )
    fire_time: Mapped[datetime | None] = mapped_column(nullable=True)
    parameter_version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the version evaluated
    total_examples: Mapped[int] = mapped_column(Integer, default=0)
    completed_examples: Mapped[int] = mapped_column(Integer, default=0)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    scores: Mapped[list[Any] | None] = mapped_column(JSONDoc, nullable=True)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)  # feedback and errors
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class FeedbackRequestRow(Base):
    __tablename__ = "feedback_requests"
    __table_args__ = (Index("ix_feedback_requests_status_created_at", "status", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # HumanFeedbackRequest.id
    training_id: Mapped[str | None] = mapped_column(ForeignKey("trainings.id", ondelete="CASCADE"), nullable=True)
    owner: Mapped[str] = mapped_column(String(64), default="anonymous")
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending, answered, expired
    request: Mapped[dict[str, Any]] = mapped_column(JSONDoc)  # HumanFeedbackRequest.to_dict()
    answer: Mapped[dict[str, Any] | None] = mapped_column(JSONDoc, nullable=True)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    answered_at: Mapped[datetime | None] = mapped_column(nullable=True)
