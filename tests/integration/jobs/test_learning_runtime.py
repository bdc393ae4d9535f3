"""The executor of trainings and evaluations on PostgreSQL: a run whose runner died (stale heartbeat) is taken
over (an evaluation runs again, a training fails as interrupted), one that kept dying is failed, and two
runners racing for one queued run never both get it."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from app.db import make_session_factory, session_scope, utcnow
from app.db.optimization_models import Evaluation, Training
from app.jobs.learning.evaluations import EvaluationRequest, submit_evaluation
from app.jobs.learning.runtime import LearningExecutor, claim
from app.jobs.learning.training import TrainingRequest, submit_training
from tests.support.fakes import ScriptedLM
from tests.support.training import DATASET, scripted


def _abandon(engine: Engine, model: Any, run_id: str, attempts: int) -> None:
    """Make the run look like its runner died a while ago, after ``attempts`` starts."""
    with engine.begin() as connection:
        connection.execute(update(model).where(model.id == run_id).values(
            status="running", attempts=attempts, heartbeat_at=utcnow() - timedelta(minutes=5)))


def _row(engine: Engine, model: Any, run_id: str) -> Any:
    with Session(engine) as session:
        return session.get(model, run_id)


async def _run_executor(engine: Engine, done: Any, timeout: float = 10.0) -> None:
    lm = ScriptedLM(scripted)
    executor = LearningExecutor(make_session_factory(engine), resources_for=lambda aliases: lm, poll_interval=0.05,
                                lease_s=30.0, max_attempts=3)
    await executor.start()
    try:
        for _ in range(int(timeout / 0.05)):
            if done():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the executor did not get there in time")
    finally:
        await executor.stop()


def test_abandoned_runs_are_taken_over_or_failed(committed: Engine) -> None:
    sessions = make_session_factory(committed)
    with session_scope(sessions) as session:
        rerun = submit_evaluation(session, EvaluationRequest(pipeline="sentiment", dataset=DATASET, metric="exact")).id
        exhausted = submit_evaluation(session, EvaluationRequest(pipeline="sentiment", dataset=DATASET,
                                                                 metric="exact")).id
        interrupted = submit_training(session, TrainingRequest(pipeline="sentiment", dataset=DATASET,
                                                               metric="exact")).id
    _abandon(committed, Evaluation, rerun, attempts=1)
    _abandon(committed, Evaluation, exhausted, attempts=3)
    _abandon(committed, Training, interrupted, attempts=1)

    def settled() -> bool:
        return all(_row(committed, model, run_id).status in {"completed", "failed"}
                   for model, run_id in ((Evaluation, rerun), (Evaluation, exhausted), (Training, interrupted)))

    asyncio.run(_run_executor(committed, settled))
    again = _row(committed, Evaluation, rerun)
    assert again.status == "completed" and again.attempts == 2 and again.score == 0.0
    gave_up = _row(committed, Evaluation, exhausted)
    assert gave_up.status == "failed" and gave_up.error["type"] == "TooManyAttempts" and gave_up.score is None
    training = _row(committed, Training, interrupted)
    assert training.status == "failed" and training.error["type"] == "Interrupted"
    assert "submit the training again" in training.error["message"]


def test_a_live_run_is_not_taken_over(committed: Engine) -> None:
    sessions = make_session_factory(committed)
    with session_scope(sessions) as session:
        run_id = submit_evaluation(session, EvaluationRequest(pipeline="sentiment", dataset=DATASET,
                                                              metric="exact")).id
    winners: list[bool] = []
    barrier = threading.Barrier(4)

    def race() -> None:
        barrier.wait()
        winners.append(claim(sessions, Evaluation, run_id, lease_s=30.0))

    threads = [threading.Thread(target=race) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(winners) == [False, False, False, True]
    assert claim(sessions, Evaluation, run_id, lease_s=30.0) is False  # it beats: nobody may take it over
    assert _row(committed, Evaluation, run_id).attempts == 1
