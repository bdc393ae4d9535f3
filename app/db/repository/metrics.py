"""Per-job metrics (tokens, cost, latency) and the job's Chrome trace."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import JobMetrics


def add_job_metrics(
    session: Session,
    *,
    job_id: str,
    llm_calls: int = 0,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cost: float = 0.0,
    latency_ms_total: float = 0.0,
    latency_ms_max: float = 0.0,
) -> None:
    """Add to the job's counters in place (concurrent writers add, never overwrite)."""
    session.execute(
        update(JobMetrics)
        .where(JobMetrics.job_id == job_id)
        .values(
            llm_calls=JobMetrics.llm_calls + llm_calls,
            input_tokens=JobMetrics.input_tokens + input_tokens,
            output_tokens=JobMetrics.output_tokens + output_tokens,
            cost=JobMetrics.cost + cost,
            latency_ms_total=JobMetrics.latency_ms_total + latency_ms_total,
            latency_ms_max=case(
                (JobMetrics.latency_ms_max < latency_ms_max, latency_ms_max), else_=JobMetrics.latency_ms_max
            ),
            updated_at=utcnow(),
        )
    )


def get_job_metrics(session: Session, *, job_id: str) -> JobMetrics | None:
    return session.get(JobMetrics, job_id, populate_existing=True)


def save_trace(session: Session, *, job_id: str, trace: dict[str, Any]) -> None:
    session.execute(update(JobMetrics).where(JobMetrics.job_id == job_id).values(trace=trace, updated_at=utcnow()))
