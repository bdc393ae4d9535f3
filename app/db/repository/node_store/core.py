"""The node store on SQLAlchemy Core (PostgreSQL and SQLite): each operation is one transaction of the prepared
Core statements in :mod:`app.db.repository.node_runs` (and :mod:`app.db.repository.node_tasks`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import ITEM_OPEN, ItemStatus, JobStatus, NodeTaskStatus
from app.db.repository import node_runs as runs
from app.db.repository import node_tasks as tasks
from app.db.repository.node_store.protocol import (
    Claim,
    ClaimedItem,
    ClaimRequest,
    ClaimStatus,
    Hold,
    ItemEnd,
    ItemEnder,
    JobProgress,
    LastStored,
    NodeValue,
    Stored,
    too_many_attempts,
)
from app.db.repository.node_tasks import NodeTaskRef
from app.db.session import session_scope

JobSettler = Callable[[Session, str], object]
"""Makes a job terminal when it is due, in the caller's transaction (the job layer's ``settle_job``)."""

_OPEN_JOB = (JobStatus.QUEUED, JobStatus.RUNNING)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)  # SQLite hands back naive UTC


def settle_due(inserted: bool, progress: JobProgress | None, job_status: str | None) -> bool:
    """After a result stored with its item's outcome: may the job be due? Its last item finished, the item was
    closed meanwhile (a cancel may be due), or the job is cancelling (this may have been its last running node)."""
    if job_status == JobStatus.CANCELLING:
        return True
    return inserted and (progress is None or progress.finished)


class CoreNodeStore:
    """:class:`~app.db.repository.node_store.protocol.NodeStore` on SQLAlchemy Core sessions."""

    def __init__(self, sessions: sessionmaker[Session], settle: JobSettler) -> None:
        self._sessions = sessions
        self._settle = settle

    # -- claim ----------------------------------------------------------------------------------------------
    def claim(self, request: ClaimRequest) -> Claim:
        with session_scope(self._sessions) as session:
            return self._claim_in(session, request)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Every claim in one transaction (one write lock and one commit on SQLite, not one per node)."""
        with session_scope(self._sessions) as session:
            return [self._claim_in(session, request) for request in requests]

    def _claim_in(self, session: Session, r: ClaimRequest) -> Claim:
        quick = runs.claim_queued(
            session,
            item_id=r.item_id,
            node_id=r.node_id,
            token=r.token,
            max_attempts=r.max_attempts,
            deadline=r.deadline,
            now=r.now,
        )
        if quick is not None:  # the common case, in one statement
            return self._claimed(session, r, quick, quick.attempts)
        row = runs.read_claim(session, item_id=r.item_id, node_id=r.node_id)
        if row is None:
            return Claim(ClaimStatus.CLOSED)  # the job was deleted
        refused = self._refusal(session, r, row)
        if refused is not None:
            return Claim(refused)
        attempts = runs.start_claim(session, row_id=row.row_id, token=r.token, deadline=r.deadline, now=r.now)
        return self._claimed(session, r, row, attempts)

    def _refusal(self, session: Session, r: ClaimRequest, row: runs.ClaimRow) -> ClaimStatus | None:
        """Why the locked node cannot be claimed (None: it can), after closing what has to be closed."""
        if row.status == NodeTaskStatus.DONE:
            return ClaimStatus.ALREADY_DONE
        if row.status == NodeTaskStatus.FAILED:
            return ClaimStatus.CLOSED
        if row.status == NodeTaskStatus.WAITING:
            return ClaimStatus.NOT_READY
        if row.job_status not in _OPEN_JOB or row.item_status not in ITEM_OPEN:
            tasks.set_node_task_status(
                session, item_id=r.item_id, node_ids=[r.node_id], status=NodeTaskStatus.FAILED
            )
            self._settle(session, r.job_id)
            return ClaimStatus.CLOSED
        live = (
            row.status == NodeTaskStatus.RUNNING and row.deadline is not None and _aware(row.deadline) > r.now
        )
        # another delivery runs it; only a re-delivery of this very task (its worker died) takes over
        if live and not (r.redelivered and row.claimed_by == r.token):
            return ClaimStatus.BUSY
        if row.attempts >= r.max_attempts:
            error = too_many_attempts(r.node_id, row.attempts)
            if tasks.fail_item(session, job_id=r.job_id, item_id=r.item_id, error=error):
                self._settle(session, r.job_id)
            return ClaimStatus.EXHAUSTED
        return None

    def _claimed(
        self, session: Session, r: ClaimRequest, row: runs.ClaimRow | runs.QuickClaim, attempts: int
    ) -> Claim:
        if row.item_status == ItemStatus.PENDING:
            runs.mark_item_running(session, item_id=r.item_id, now=r.now)
        values = runs.item_values(session, item_id=r.item_id)
        item = ClaimedItem(row.pipeline_name, row.pipeline_id, row.item_input, row.custom_id, values)
        return Claim(ClaimStatus.CLAIMED, attempts, item)

    # -- while it runs --------------------------------------------------------------------------------------
    def renew(self, *, item_id: int, node_id: str, token: str, deadline: datetime) -> bool:
        with session_scope(self._sessions) as session:
            return tasks.renew_node_lease(
                session, item_id=item_id, node_id=node_id, token=token, deadline=deadline
            )

    def item_values(self, *, item_id: int) -> dict[str, Any]:
        with session_scope(self._sessions) as session:
            return runs.item_values(session, item_id=item_id)

    # -- store ----------------------------------------------------------------------------------------------
    def store(
        self, value: NodeValue, *, dependents: Sequence[str], deadline: datetime, hold: Hold | None = None
    ) -> Stored:
        with session_scope(self._sessions) as session:
            inserted = runs.store_result(session, value)
            ready: list[NodeTaskRef] = []
            if inserted and dependents:
                ready = runs.release(
                    session,
                    job_id=value.job_id,
                    item_id=value.item_id,
                    node_ids=dependents,
                    deadline=deadline,
                    now=value.now,
                    hold=hold,
                )
            return Stored(inserted, ready, runs.job_status(session, job_id=value.job_id))

    def store_last(self, value: NodeValue, end: ItemEnd) -> LastStored:
        with session_scope(self._sessions) as session:
            inserted = runs.store_result(session, value)
            progress = None
            if inserted:
                progress = runs.finish_open_item(
                    session, job_id=value.job_id, item_id=value.item_id, end=end, now=value.now
                )
            job_status = runs.job_status(session, job_id=value.job_id)
            if settle_due(inserted, progress, job_status):
                self._settle(session, value.job_id)
            return LastStored(inserted, progress, job_status)

    def store_sink(self, value: NodeValue, end: ItemEnder) -> LastStored:
        with session_scope(self._sessions) as session:
            inserted = runs.store_result(session, value)
            progress = None
            if inserted:
                progress = runs.finish_item(
                    session, job_id=value.job_id, item_id=value.item_id, end=end, now=value.now
                )
            job_status = runs.job_status(session, job_id=value.job_id)
            if (progress is not None and progress.finished) or job_status == JobStatus.CANCELLING:
                self._settle(session, value.job_id)
            return LastStored(inserted, progress, job_status)

    def finish_item(self, *, job_id: str, item_id: int, end: ItemEnder) -> JobProgress | None:
        with session_scope(self._sessions) as session:
            progress = runs.finish_item(session, job_id=job_id, item_id=item_id, end=end, now=utcnow())
            if progress is not None and progress.finished:
                self._settle(session, job_id)
            return progress

    # -- retry, failure, settling ---------------------------------------------------------------------------
    def requeue(self, *, item_id: int, node_id: str, token: str, deadline: datetime) -> NodeTaskRef | None:
        with session_scope(self._sessions) as session:
            row = tasks.lock_node_task(session, item_id=item_id, node_id=node_id)
            if row is None or row.status != NodeTaskStatus.RUNNING or row.claimed_by != token:
                return None  # finished or taken over meanwhile
            return tasks.requeue_node_task(
                session, row_id=row.id, expect_status=NodeTaskStatus.RUNNING, deadline=deadline
            )

    def fail(self, *, job_id: str, item_id: int, node_id: str, error: dict[str, Any]) -> None:
        with session_scope(self._sessions) as session:
            tasks.set_node_task_status(
                session, item_id=item_id, node_ids=[node_id], status=NodeTaskStatus.FAILED
            )
            if tasks.fail_item(session, job_id=job_id, item_id=item_id, error=error):
                self._settle(session, job_id)

    def settle(self, *, job_id: str) -> None:
        with session_scope(self._sessions) as session:
            self._settle(session, job_id)
