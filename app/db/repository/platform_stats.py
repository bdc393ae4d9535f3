"""Counts for the platform's metrics: jobs per status and finished items per outcome (one grouped query), and
each tenant's open items (one grouped query over the open jobs)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.models import Item, ItemStatus, Job
from app.db.repository.quotas import OPEN_JOB_STATUSES


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


def tenant_item_counts(session: Session) -> dict[str, dict[str, int]]:
    """``{tenant: {"pending": n, "running": m}}`` over the jobs not finished. Open items come from each job's
    counters and running ones from the items index ``(job_id, status, ...)``, so the query reads one row per open
    job plus its running items, however many items wait."""
    running = (
        select(func.count())
        .where(Item.job_id == Job.id, Item.status == ItemStatus.RUNNING.value)
        .correlate(Job)
        .scalar_subquery()
    )
    per_job = (
        select(
            Job.owner.label("tenant"),
            (Job.total_items - Job.completed_items - Job.failed_items - Job.cancelled_items).label("open"),
            running.label("running"),
        )
        .where(Job.status.in_(OPEN_JOB_STATUSES))
        .subquery()
    )
    stmt = select(per_job.c.tenant, func.sum(per_job.c.open), func.sum(per_job.c.running)).group_by(per_job.c.tenant)
    counts: dict[str, dict[str, int]] = {}
    for tenant, open_items, running_items in session.execute(stmt):
        running_now = int(running_items or 0)
        counts[str(tenant)] = {"pending": max(0, int(open_items or 0) - running_now), "running": running_now}
    return counts
