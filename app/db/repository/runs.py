"""Trainings and evaluations share a life cycle (queued → running → terminal) and the way a runner holds one:
an atomic claim, a heartbeat while it runs, and reclaiming a run whose runner stopped beating. These functions
take the model class (``Training`` or ``Evaluation``) so both tables follow the same rules."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.optimization_models import Evaluation, RunStatus, Training

Run = TypeVar("Run", Training, Evaluation)

_OPEN = (RunStatus.QUEUED, RunStatus.RUNNING)


def get_run(session: Session, model: type[Run], *, run_id: str, owner: str | None = None) -> Run | None:
    row = session.get(model, run_id, populate_existing=True)
    if row is None or (owner is not None and row.owner != owner):
        return None
    return row


def list_runs(
    session: Session,
    model: type[Run],
    *,
    owner: str | None = None,
    pipeline_id: int | None = None,
    after: str | None = None,
    limit: int = 20,
) -> list[Run]:
    """Newest first; ids grow with time, so ``after`` (the previous page's last id) is the cursor."""
    stmt = select(model).order_by(model.id.desc()).limit(limit)
    if owner is not None:
        stmt = stmt.where(model.owner == owner)
    if pipeline_id is not None:
        stmt = stmt.where(model.pipeline_id == pipeline_id)
    if after is not None:
        stmt = stmt.where(model.id < after)
    return list(session.scalars(stmt))


def claimable_ids(
    session: Session, model: type[Run], *, stale_before: datetime, max_attempts: int, limit: int = 8
) -> list[str]:
    """Queued runs, and running ones whose runner stopped beating before ``stale_before`` (it died), oldest
    first; runs that used up ``max_attempts`` are left to :func:`exhausted_ids`."""
    stmt = (
        select(model.id)
        .where(
            or_(
                model.status == RunStatus.QUEUED,
                (model.status == RunStatus.RUNNING) & (model.heartbeat_at < stale_before),
            ),
            model.attempts < max_attempts,
        )
        .order_by(model.id)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def claim_run(session: Session, model: type[Run], *, run_id: str, stale_before: datetime) -> bool:
    """Take the run for this runner: queued → running, or a stale running one taken over. The conditional
    UPDATE makes two runners racing for one run safe: exactly one of them gets rowcount 1."""
    now = utcnow()
    result = session.execute(
        update(model)
        .where(
            model.id == run_id,
            or_(
                model.status == RunStatus.QUEUED,
                (model.status == RunStatus.RUNNING) & (model.heartbeat_at < stale_before),
            ),
        )
        .values(status=RunStatus.RUNNING, attempts=model.attempts + 1, started_at=now, heartbeat_at=now,
                updated_at=now)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def exhausted_ids(session: Session, model: type[Run], *, stale_before: datetime, max_attempts: int) -> list[str]:
    """Runs whose runners kept dying: stale and out of attempts (they are failed, not retried forever)."""
    stmt = select(model.id).where(
        model.status == RunStatus.RUNNING, model.heartbeat_at < stale_before, model.attempts >= max_attempts
    )
    return list(session.scalars(stmt))


def beat(session: Session, model: type[Run], *, run_ids: Iterable[str]) -> None:
    """Renew the heartbeat of the runs this runner holds."""
    ids = list(run_ids)
    if ids:
        session.execute(
            update(model).where(model.id.in_(ids), model.status.in_((RunStatus.RUNNING, RunStatus.CANCELLING)))
            .values(heartbeat_at=utcnow())
        )


def request_cancel(session: Session, model: type[Run], *, run_id: str) -> bool:
    """queued/running → cancelling; False when the run was not open."""
    now = utcnow()
    result = session.execute(
        update(model).where(model.id == run_id, model.status.in_(_OPEN))
        .values(status=RunStatus.CANCELLING, updated_at=now)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def finish_run(session: Session, model: type[Run], *, run_id: str, status: RunStatus, **values: Any) -> bool:
    """Move an unfinished run to a terminal ``status`` with ``values`` (score, result, error...)."""
    if status not in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        raise ValueError(f"{status} is not a terminal status")
    now = utcnow()
    result = session.execute(
        update(model)
        .where(model.id == run_id, model.status.in_((*_OPEN, RunStatus.CANCELLING)))
        .values(status=status, finished_at=now, updated_at=now, **values)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def set_progress(session: Session, model: type[Run], *, run_id: str, **values: Any) -> None:
    """Progress counters of a running run (completed steps or examples), with a heartbeat."""
    now = utcnow()
    session.execute(update(model).where(model.id == run_id).values(heartbeat_at=now, updated_at=now, **values))
