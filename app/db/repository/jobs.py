"""Jobs: creation, look-up, listing with a cursor, and the status transitions (each with its timestamp)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import Job, JobMetrics, JobStatus

_OPEN = (JobStatus.QUEUED, JobStatus.RUNNING)


def create_job(
    session: Session,
    *,
    job_id: str,
    pipeline_id: int,
    pipeline_name: str,
    total_items: int,
    priority: int = 0,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    owner: str = "anonymous",
    input_file_id: str | None = None,
    kind: str = "pipeline",
    expires_at: datetime | None = None,
) -> Job:
    job = Job(
        id=job_id, kind=kind, pipeline_id=pipeline_id, pipeline_name=pipeline_name, status=JobStatus.QUEUED,
        priority=priority, metadata_=metadata or {}, idempotency_key=idempotency_key, request_hash=request_hash,
        owner=owner,
        input_file_id=input_file_id, total_items=total_items, expires_at=expires_at,
    )
    session.add(job)
    session.add(JobMetrics(job_id=job_id))
    session.flush()
    return job


def get_job(session: Session, *, job_id: str, owner: str | None = None) -> Job | None:
    """The job, or None when it does not exist or belongs to another owner."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or (owner is not None and job.owner != owner):
        return None
    return job


def find_job_by_idempotency_key(session: Session, *, owner: str, key: str) -> Job | None:
    stmt = select(Job).where(Job.owner == owner, Job.idempotency_key == key)
    return session.scalars(stmt).one_or_none()


def list_jobs(
    session: Session,
    *,
    owner: str | None = None,
    statuses: Iterable[str] | None = None,
    kind: str | None = None,
    pipeline: str | None = None,
    after: str | None = None,
    limit: int = 20,
) -> list[Job]:
    """Newest first. Job ids grow with time, so ``after`` (the last id of the previous page) is the cursor.
    ``pipeline`` is the pipeline's name exactly as the jobs were submitted with it."""
    stmt = select(Job).order_by(Job.id.desc()).limit(limit)
    if owner is not None:
        stmt = stmt.where(Job.owner == owner)
    if pipeline is not None:
        stmt = stmt.where(Job.pipeline_name == pipeline)
    if statuses is not None:
        stmt = stmt.where(Job.status.in_(list(statuses)))
    if kind is not None:
        stmt = stmt.where(Job.kind == kind)
    if after is not None:
        stmt = stmt.where(Job.id < after)
    return list(session.scalars(stmt))


def jobs_with_status(session: Session, *, statuses: Iterable[str], kind: str | None = None) -> list[Job]:
    stmt = select(Job).where(Job.status.in_(list(statuses))).order_by(Job.priority, Job.id)
    if kind is not None:
        stmt = stmt.where(Job.kind == kind)
    return list(session.scalars(stmt))


def claim_next_job(session: Session, *, exclude: Iterable[str] = ()) -> Job | None:
    """Move the most urgent queued job (lowest priority value, then oldest) to running; None when none is
    queued. The conditional UPDATE makes the claim safe against a concurrent cancel or another claimer."""
    excluded = list(exclude)
    stmt = select(Job.id).where(Job.status == JobStatus.QUEUED).order_by(Job.priority, Job.id).limit(8)
    if excluded:
        stmt = stmt.where(Job.id.not_in(excluded))
    for job_id in session.scalars(stmt).all():
        if claim_job(session, job_id=job_id):
            return get_job(session, job_id=job_id)
    return None


def claim_job(session: Session, *, job_id: str) -> bool:
    """queued → running for this job (its dispatch started); False
    when it was not queued (a concurrent cancel or claimer)."""
    now = utcnow()
    claimed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.RUNNING, started_at=now, updated_at=now)
    )
    return bool(claimed.rowcount == 1)  # type: ignore[attr-defined]


def request_cancel(session: Session, *, job_id: str) -> bool:
    """queued/running → cancelling; False when the job was not open (already finished or cancelling)."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(_OPEN))
        .values(status=JobStatus.CANCELLING, cancelling_at=now, updated_at=now)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def finish_job(
    session: Session, *, job_id: str, status: JobStatus, error: dict[str, Any] | None = None
) -> bool:
    """Move an unfinished job to a terminal status, stamping that status's time and ``finished_at``."""
    stamps = {
        JobStatus.COMPLETED: "completed_at",
        JobStatus.FAILED: "failed_at",
        JobStatus.CANCELLED: "cancelled_at",
    }
    if status not in stamps:
        raise ValueError(f"{status} is not a terminal job status")
    now = utcnow()
    values: dict[str, Any] = {"status": status, stamps[status]: now, "finished_at": now, "updated_at": now}
    if error is not None:
        values["error"] = error
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_((*_OPEN, JobStatus.CANCELLING)))
        .values(**values)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def set_job_error(session: Session, *, job_id: str, error: dict[str, Any]) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(error=error, updated_at=utcnow()))
