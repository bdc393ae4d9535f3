"""Counts for the platform's metrics: jobs per status and finished items per outcome (one grouped query)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.models import Job


def job_status_counts(session: Session) -> tuple[dict[str, int], dict[str, int]]:
    """``({status: jobs}, {"completed"|"failed"|"cancelled": items})`` over every job."""
    stmt = select(
        Job.status,
        func.count(),
        func.coalesce(func.sum(Job.completed_items), 0),
        func.coalesce(func.sum(Job.failed_items), 0),
        func.coalesce(func.sum(Job.cancelled_items), 0),
    ).group_by(Job.status)
    jobs: dict[str, int] = {}
    items = {"completed": 0, "failed": 0, "cancelled": 0}
    for status, count, completed, failed, cancelled in session.execute(stmt):
        jobs[status] = int(count)
        items["completed"] += int(completed)
        items["failed"] += int(failed)
        items["cancelled"] += int(cancelled)
    return jobs, items
