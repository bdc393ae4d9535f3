"""Human feedback over REST: a training's human loss asks through a ``PollingFeedbackSource`` whose requests are
rows of ``feedback_requests``; people list them (``GET /v1/feedback/pending``) and answer them
(``POST /v1/feedback/{request_id}``), possibly through another server process: the database is the meeting point.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope, to_unix
from app.db.optimization_models import FeedbackRequestRow
from app.db.repository import learning as repo
from app.jobs.errors import InvalidJobInput, JobConflict, JobNotFound
from app.pipeline.optimization import HumanFeedbackRequest, PollingFeedbackSource

POLL_SECONDS = 0.5


def database_source(
    sessions: sessionmaker[Session], *, training_id: str, owner: str, interval: float = POLL_SECONDS,
    timeout: float | None = None,
) -> PollingFeedbackSource:
    """A feedback source whose open requests are stored for the REST API and whose answers are read back."""

    def publish(request: HumanFeedbackRequest) -> Any:
        return asyncio.to_thread(_publish, sessions, request, training_id, owner)

    def fetch(request_id: str) -> Any:
        return asyncio.to_thread(_fetch, sessions, request_id)

    return PollingFeedbackSource(publish, fetch, interval=interval, timeout=timeout)


def _publish(sessions: sessionmaker[Session], request: HumanFeedbackRequest, training_id: str, owner: str) -> None:
    with session_scope(sessions) as session:
        repo.add_feedback_request(session, request_id=request.id, request=request.to_dict(), owner=owner,
                                  training_id=training_id)


def _fetch(sessions: sessionmaker[Session], request_id: str) -> dict[str, Any] | None:
    with session_scope(sessions) as session:
        row = repo.get_feedback_request(session, request_id=request_id)
        return dict(row.answer) if row is not None and row.status == "answered" and row.answer else None


# -- the REST side ----------------------------------------------------------------------------------------------
def feedback_view(row: FeedbackRequestRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "feedback_request",
        "training_id": row.training_id,
        "status": row.status,
        **{k: v for k, v in row.request.items() if k != "id"},
        "answer": row.answer,
        "created_at": to_unix(row.created_at),
        "answered_at": to_unix(row.answered_at),
    }


def pending_views(session: Session, *, owner: str | None, training_id: str | None = None,
                  limit: int = 100) -> dict[str, Any]:
    rows = repo.pending_feedback(session, owner=owner, training_id=training_id, limit=limit)
    return {"object": "list", "data": [feedback_view(row) for row in rows]}


def answer_request(session: Session, request_id: str, answer: Any, *, owner: str | None) -> dict[str, Any]:
    """Validate ``answer`` against the stored request (a rubric score must be a level, a preference A or B...)
    and store it for the waiting training."""
    row = repo.get_feedback_request(session, request_id=request_id, owner=owner)
    if row is None:
        raise JobNotFound(f"no feedback request {request_id!r}: list the open ones with GET /v1/feedback/pending",
                          param="request_id", code="feedback_request_not_found")
    if row.status != "pending":
        raise JobConflict(f"feedback request {request_id} is already {row.status}", param="request_id",
                          code="feedback_request_closed")
    request = HumanFeedbackRequest.from_dict(row.request)
    try:
        valid = request.validate(answer)
    except (ValueError, TypeError) as exc:
        raise InvalidJobInput(f"invalid answer to a {request.kind} request: {exc}", param="answer") from None
    if not repo.answer_feedback(session, request_id=request_id, answer=asdict(valid)):
        raise JobConflict(f"feedback request {request_id} was answered meanwhile", param="request_id",
                          code="feedback_request_closed")
    row = repo.get_feedback_request(session, request_id=request_id)
    assert row is not None
    return feedback_view(row)
