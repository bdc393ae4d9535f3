"""OpenAI Batch API batches: creation, look-up with their job, listing, and the transitions they own."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import Batch, BatchStatus, Job


def create_batch(
    session: Session,
    *,
    batch_id: str,
    owner: str,
    endpoint: str,
    completion_window: str,
    input_file_id: str,
    metadata: dict[str, Any] | None,
    created_at: datetime,
    expires_at: datetime | None,
    job_id: str | None = None,
    status: BatchStatus = BatchStatus.VALIDATING,
    errors: dict[str, Any] | None = None,
) -> Batch:
    batch = Batch(
        id=batch_id, owner=owner, job_id=job_id, endpoint=endpoint, completion_window=completion_window,
        input_file_id=input_file_id, status=status, errors=errors, metadata_=metadata, created_at=created_at,
        expires_at=expires_at, failed_at=created_at if status == BatchStatus.FAILED else None,
    )
    session.add(batch)
    session.flush()
    return batch


def get_batch(
    session: Session, *, batch_id: str, owner: str | None = None, for_update: bool = False
) -> tuple[Batch, Job | None] | None:
    """The batch and its job (None for a batch that failed validation). ``for_update`` locks the batch row, so
    that one reader at a time moves it on (expiry, finalisation)."""
    stmt = select(Batch).where(Batch.id == batch_id).execution_options(populate_existing=True)
    if owner is not None:
        stmt = stmt.where(Batch.owner == owner)
    if for_update:
        stmt = stmt.with_for_update()
    batch = session.scalars(stmt).one_or_none()
    if batch is None:
        return None
    job = session.get(Job, batch.job_id, populate_existing=True) if batch.job_id else None
    return batch, job


def list_batches(
    session: Session, *, owner: str | None = None, after: str | None = None, limit: int = 20
) -> list[tuple[Batch, Job | None]]:
    """Newest first (batch ids grow with time); ``after`` is the last id of the previous page."""
    stmt = (
        select(Batch, Job)
        .outerjoin(Job, Job.id == Batch.job_id)
        .order_by(Batch.id.desc())
        .limit(limit)
        .execution_options(populate_existing=True)
    )
    if owner is not None:
        stmt = stmt.where(Batch.owner == owner)
    if after is not None:
        stmt = stmt.where(Batch.id < after)
    return [(batch, job) for batch, job in session.execute(stmt).all()]


def mark_batch_cancelling(session: Session, *, batch: Batch, at: datetime) -> None:
    if batch.cancelling_at is None:
        batch.cancelling_at = at
        session.flush()


def mark_batch_expired(session: Session, *, batch: Batch, at: datetime) -> None:
    """The completion window ran out: its job is being cancelled, and the batch will end ``expired``."""
    if batch.expired_at is None:
        batch.expired_at = at
        session.flush()


def finish_batch(
    session: Session,
    *,
    batch: Batch,
    status: BatchStatus,
    at: datetime,
    finalizing_at: datetime | None = None,
    output_file_id: str | None = None,
    error_file_id: str | None = None,
    errors: dict[str, Any] | None = None,
) -> None:
    """Make the batch final: its status, the time stamp of that status, and its files."""
    stamps = {
        BatchStatus.COMPLETED: "completed_at",
        BatchStatus.FAILED: "failed_at",
        BatchStatus.CANCELLED: "cancelled_at",
        BatchStatus.EXPIRED: "expired_at",
    }
    if status not in stamps:
        raise ValueError(f"{status} is not a final batch status")
    batch.status = status
    if getattr(batch, stamps[status]) is None:
        setattr(batch, stamps[status], at)
    batch.finalizing_at = finalizing_at
    batch.output_file_id = output_file_id
    batch.error_file_id = error_file_id
    if errors is not None:
        batch.errors = errors
    session.flush()
