"""Rows of training and evaluation: trainings and their steps, parameter versions by number (listing, activating),
evaluations and their schedules, human feedback requests."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import ParameterVersion, Pipeline
from app.db.optimization_models import (
    Evaluation,
    EvaluationSchedule,
    FeedbackRequestRow,
    RunStatus,
    Training,
    TrainingStepRow,
)
from app.db.repository._dialect import insert_ignoring_conflicts


# -- trainings ------------------------------------------------------------------------------------------------
def create_training(
    session: Session, *, training_id: str, pipeline_id: int, pipeline_name: str, owner: str,
    request: dict[str, Any], total_steps: int,
) -> Training:
    row = Training(
        id=training_id, pipeline_id=pipeline_id, pipeline_name=pipeline_name, owner=owner,
        status=RunStatus.QUEUED, request=request, total_steps=total_steps, completed_steps=0, attempts=0,
    )
    session.add(row)
    session.flush()
    return row


def add_training_step(session: Session, *, training_id: str, values: dict[str, Any]) -> None:
    """Store one step (idempotent per (training, step): a step stored twice keeps its first row)."""
    stmt = insert_ignoring_conflicts(session, TrainingStepRow, ["training_id", "step"]).values(
        training_id=training_id, created_at=utcnow(), **values
    )
    session.execute(stmt)


def training_steps(session: Session, *, training_id: str) -> list[TrainingStepRow]:
    stmt = select(TrainingStepRow).where(TrainingStepRow.training_id == training_id).order_by(TrainingStepRow.step)
    return list(session.scalars(stmt))


# -- parameter versions -----------------------------------------------------------------------------------------
def get_parameter_version(session: Session, *, pipeline_id: int, version: int) -> ParameterVersion | None:
    stmt = select(ParameterVersion).where(
        ParameterVersion.pipeline_id == pipeline_id, ParameterVersion.version == version
    )
    return session.scalars(stmt).one_or_none()


def append_parameter_version(
    session: Session,
    *,
    pipeline_id: int,
    state: dict[str, Any],
    note: str | None = None,
    metadata: dict[str, Any] | None = None,
    score: float | None = None,
    activate: bool = False,
) -> ParameterVersion:
    """Append the pipeline's next parameter version; with ``activate`` it also becomes the active state. The
    pipeline row is locked, so concurrent appenders get distinct numbers."""
    pipeline = session.get(Pipeline, pipeline_id, with_for_update=True)
    if pipeline is None:
        raise LookupError(f"no pipeline with id {pipeline_id}")
    latest = session.scalar(
        select(func.max(ParameterVersion.version)).where(ParameterVersion.pipeline_id == pipeline_id)
    )
    row = ParameterVersion(pipeline_id=pipeline_id, version=(latest or 0) + 1, state=state, score=score, note=note,
                           metadata_=metadata or {})
    session.add(row)
    if activate:
        pipeline.parameter_state = dict(state)
        pipeline.parameter_version = row.version
    session.flush()
    return row


def set_version_score(session: Session, *, pipeline_id: int, version: int, score: float | None) -> None:
    session.execute(
        update(ParameterVersion)
        .where(ParameterVersion.pipeline_id == pipeline_id, ParameterVersion.version == version)
        .values(score=score)
    )


def activate_parameter_version(session: Session, *, pipeline_id: int, version: int) -> Pipeline:
    """Make a stored version the pipeline's current parameters (what later jobs load); history is unchanged."""
    pipeline = session.get(Pipeline, pipeline_id, with_for_update=True)
    if pipeline is None:
        raise LookupError(f"no pipeline with id {pipeline_id}")
    row = get_parameter_version(session, pipeline_id=pipeline_id, version=version)
    if row is None:
        raise LookupError(f"pipeline {pipeline.name} has no parameter version {version}")
    pipeline.parameter_state = dict(row.state)
    pipeline.parameter_version = version
    session.flush()
    return pipeline


# -- evaluations ------------------------------------------------------------------------------------------------
def create_evaluation(
    session: Session, *, evaluation_id: str, pipeline_id: int, pipeline_name: str, owner: str,
    request: dict[str, Any], total_examples: int, schedule_id: str | None = None, fire_time: datetime | None = None,
) -> bool:
    """Insert a queued evaluation; False when its (schedule, fire time) already has one (a second firing)."""
    now = utcnow()
    stmt = insert_ignoring_conflicts(session, Evaluation, ["schedule_id", "fire_time"]).values(
        id=evaluation_id, pipeline_id=pipeline_id, pipeline_name=pipeline_name, owner=owner,
        status=RunStatus.QUEUED, request=request, schedule_id=schedule_id, fire_time=fire_time,
        total_examples=total_examples, completed_examples=0, attempts=0, created_at=now, updated_at=now,
    ).returning(Evaluation.id)
    # RETURNING names the row only when it was inserted (ORM inserts report no reliable rowcount)
    return session.execute(stmt).first() is not None


def create_schedule(
    session: Session, *, schedule_id: str, pipeline_id: int, pipeline_name: str, owner: str,
    request: dict[str, Any], cron: str, margin: float, next_fire_at: datetime,
) -> EvaluationSchedule:
    row = EvaluationSchedule(
        id=schedule_id, pipeline_id=pipeline_id, pipeline_name=pipeline_name, owner=owner, request=request,
        cron=cron, margin=margin, enabled=True, next_fire_at=next_fire_at,
    )
    session.add(row)
    session.flush()
    return row


def get_schedule(session: Session, *, schedule_id: str, owner: str | None = None) -> EvaluationSchedule | None:
    row = session.get(EvaluationSchedule, schedule_id, populate_existing=True)
    if row is None or (owner is not None and row.owner != owner):
        return None
    return row


def list_schedules(session: Session, *, owner: str | None = None) -> list[EvaluationSchedule]:
    stmt = select(EvaluationSchedule).order_by(EvaluationSchedule.id)
    if owner is not None:
        stmt = stmt.where(EvaluationSchedule.owner == owner)
    return list(session.scalars(stmt))


def due_schedules(session: Session, *, now: datetime, limit: int = 100) -> list[EvaluationSchedule]:
    stmt = (
        select(EvaluationSchedule)
        .where(EvaluationSchedule.enabled.is_(True), EvaluationSchedule.next_fire_at <= now)
        .order_by(EvaluationSchedule.next_fire_at)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def advance_schedule(
    session: Session, *, schedule_id: str, fired_at: datetime, next_fire_at: datetime
) -> None:
    """Move the schedule past a fire time. Never backwards: a slower, concurrent firer cannot undo it."""
    session.execute(
        update(EvaluationSchedule)
        .where(EvaluationSchedule.id == schedule_id, EvaluationSchedule.next_fire_at < next_fire_at)
        .values(next_fire_at=next_fire_at, last_fire_at=fired_at, updated_at=utcnow())
        # no in-session evaluation of the WHERE: SQLite hands back naive datetimes, next_fire_at is aware
        .execution_options(synchronize_session=False)
    )


def set_schedule_enabled(session: Session, *, schedule_id: str, enabled: bool, next_fire_at: datetime) -> None:
    session.execute(
        update(EvaluationSchedule).where(EvaluationSchedule.id == schedule_id)
        .values(enabled=enabled, next_fire_at=next_fire_at, updated_at=utcnow())
    )


def schedule_runs(session: Session, *, schedule_id: str) -> list[Evaluation]:
    stmt = select(Evaluation).where(Evaluation.schedule_id == schedule_id).order_by(Evaluation.fire_time)
    return list(session.scalars(stmt))


# -- human feedback ---------------------------------------------------------------------------------------------
def add_feedback_request(
    session: Session, *, request_id: str, request: dict[str, Any], owner: str, training_id: str | None
) -> None:
    stmt = insert_ignoring_conflicts(session, FeedbackRequestRow, ["id"]).values(
        id=request_id, request=request, owner=owner, training_id=training_id, status="pending",
        created_at=utcnow(),
    )
    session.execute(stmt)


def get_feedback_request(session: Session, *, request_id: str, owner: str | None = None) -> FeedbackRequestRow | None:
    row = session.get(FeedbackRequestRow, request_id, populate_existing=True)
    if row is None or (owner is not None and row.owner != owner):
        return None
    return row


def pending_feedback(
    session: Session, *, owner: str | None = None, training_id: str | None = None, limit: int = 100
) -> list[FeedbackRequestRow]:
    stmt = (
        select(FeedbackRequestRow)
        .where(FeedbackRequestRow.status == "pending")
        .order_by(FeedbackRequestRow.created_at, FeedbackRequestRow.id)
        .limit(limit)
    )
    if owner is not None:
        stmt = stmt.where(FeedbackRequestRow.owner == owner)
    if training_id is not None:
        stmt = stmt.where(FeedbackRequestRow.training_id == training_id)
    return list(session.scalars(stmt))


def answer_feedback(session: Session, *, request_id: str, answer: dict[str, Any]) -> bool:
    """pending → answered with ``answer``; False when it was not pending (answered already, or expired)."""
    result = session.execute(
        update(FeedbackRequestRow)
        .where(FeedbackRequestRow.id == request_id, FeedbackRequestRow.status == "pending")
        .values(status="answered", answer=answer, answered_at=utcnow())
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def expire_feedback(session: Session, *, training_id: str, note: str) -> None:
    """Close the requests a finished training left open (nobody waits for their answers any more)."""
    session.execute(
        update(FeedbackRequestRow)
        .where(FeedbackRequestRow.training_id == training_id, FeedbackRequestRow.status == "pending")
        .values(status="expired", note=note)
    )
