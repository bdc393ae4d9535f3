"""The queries of tenant quotas (``app.jobs.limits.quotas``): the lock that serialises one tenant's submissions
and the count of its open items.

Open items are counted from the job rows' counters (total minus completed, failed and cancelled, kept in the
transaction that finishes items), so the count reads one row per open job, never the items themselves.
"""

from __future__ import annotations

import zlib

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.models import JOB_TERMINAL, Job, JobStatus

#: the statuses of jobs whose items may still be open (an IN list: ``ix_jobs_status_priority_id`` serves it)
OPEN_JOB_STATUSES = [status.value for status in JobStatus if status not in JOB_TERMINAL]

#: the first key of the tenants' quota locks (``pg_advisory_xact_lock(int, int)``: the second is the tenant's
#: hash); the two-key locks never meet the one-key locks of migrations and dispatch
QUOTA_LOCK_CLASS = zlib.crc32(b"inf-engine:tenant-quota") & 0x7FFFFFFF


def lock_tenant_quota(session: Session, *, tenant: str) -> None:
    """Serialise the tenant's submissions until the transaction ends (PostgreSQL: a transaction-level advisory
    lock keyed on the tenant), so two of them cannot both pass a quota that only one fits. SQLite needs none: its
    transactions take the database's one write lock as they begin."""
    if session.get_bind().dialect.name != "postgresql":
        return
    session.execute(select(func.pg_advisory_xact_lock(QUOTA_LOCK_CLASS, func.hashtext(tenant))))


def open_item_count(session: Session, *, tenant: str) -> int:
    """Items the tenant has pending or running in its jobs that are not finished."""
    open_items = Job.total_items - Job.completed_items - Job.failed_items - Job.cancelled_items
    stmt = select(func.coalesce(func.sum(open_items), 0)).where(
        Job.status.in_(OPEN_JOB_STATUSES), Job.owner == tenant
    )
    return int(session.execute(stmt).scalar_one())
