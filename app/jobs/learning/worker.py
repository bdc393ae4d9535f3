"""Scheduled evaluations on Celery: what the beat's periodic task and the evaluation task of a worker call.

``fire()`` queues one evaluation per due (schedule, fire time) and returns the ids to send to workers, plus the
scheduled evaluations still queued long after they were fired (their message was lost: a worker died before
acknowledging, or Redis restarted); sending one twice is harmless, since only one runner can claim it.
``run(evaluation_id)`` claims and runs one evaluation in this process.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.db import create_db_engine, database_url, make_session_factory, session_scope, utcnow
from app.db.optimization_models import Evaluation, RunStatus
from app.jobs.learning.evaluations import fire_due_schedules
from app.jobs.learning.runtime import run_evaluation_once
from app.settings import Settings


class LearningWorker:
    def __init__(self, settings: Settings, *, lease_s: float = 60.0) -> None:
        self.settings = settings
        self.lease_s = lease_s
        self.sessions: sessionmaker[Session] = make_session_factory(create_db_engine(database_url(settings)))

    def fire(self) -> list[str]:
        with session_scope(self.sessions) as session:
            created = fire_due_schedules(session)
        resend_before = utcnow() - timedelta(seconds=max(60.0, 4 * self.settings.evaluation_schedule_interval))
        with session_scope(self.sessions) as session:
            stmt = select(Evaluation.id).where(
                Evaluation.status == RunStatus.QUEUED, Evaluation.schedule_id.is_not(None),
                Evaluation.created_at < resend_before,
            ).limit(100)
            lost = [i for i in session.scalars(stmt) if i not in created]
        return created + lost

    def run(self, evaluation_id: str) -> bool:
        return run_evaluation_once(self.sessions, evaluation_id, settings=self.settings, lease_s=self.lease_s)

    def queue_kind(self) -> str:
        """Evaluations call LLMs: remote endpoints (a resources file) or the engine in an --engine worker."""
        return "llm" if self.settings.resources_file is not None else "engine"
