"""Per-job metrics (tokens, cost, latency) and the job's Chrome trace."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, defer

from app.db.base import utcnow
from app.db.models import JobMetrics


def get_job_metrics(session: Session, *, job_id: str) -> JobMetrics | None:
    return session.get(JobMetrics, job_id, populate_existing=True)


def job_metrics_of(session: Session, *, job_ids: Collection[str]) -> dict[str, JobMetrics]:
    """The metrics of several jobs in one query (a listing's page), by job id; the trace, which can be large,
    is not loaded."""
    if not job_ids:
        return {}
    stmt = select(JobMetrics).options(defer(JobMetrics.trace)).where(JobMetrics.job_id.in_(list(job_ids)))
    return {row.job_id: row for row in session.scalars(stmt)}


def save_trace(session: Session, *, job_id: str, trace: dict[str, Any]) -> None:
    session.execute(update(JobMetrics).where(JobMetrics.job_id == job_id).values(trace=trace, updated_at=utcnow()))
