"""Per-job metrics (tokens, cost, latency) and the job's Chrome trace."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import JobMetrics


def get_job_metrics(session: Session, *, job_id: str) -> JobMetrics | None:
    return session.get(JobMetrics, job_id, populate_existing=True)


def save_trace(session: Session, *, job_id: str, trace: dict[str, Any]) -> None:
    session.execute(update(JobMetrics).where(JobMetrics.job_id == job_id).values(trace=trace, updated_at=utcnow()))
