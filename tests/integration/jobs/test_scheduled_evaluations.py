"""Scheduled evaluations on PostgreSQL: firing is idempotent per (schedule, fire time) even when two firers race,
and a schedule's runs form a time series with regression flags."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from app.db import make_session_factory, session_scope, utcnow
from app.db.optimization_models import Evaluation, EvaluationSchedule
from app.jobs.learning import evaluations
from app.jobs.learning.evaluations import EvaluationRequest, EvaluationRun
from app.pipeline.resources.types import LLMRequest
from tests.support.fakes import ScriptedLM

DATASET = [{"input": f"review {i}", "target": "positive" if i % 2 == 0 else "negative"} for i in range(4)]


def _schedule(engine: Engine, cron: str = "* * * * *", margin: float = 0.0) -> str:
    with session_scope(make_session_factory(engine)) as session:
        row = evaluations.create_schedule(
            session, EvaluationRequest(pipeline="sentiment", dataset=DATASET, metric="exact"), cron=cron,
            margin=margin,
        )
        return row.id


def _due_at(engine: Engine, schedule_id: str, moment: datetime) -> None:
    with engine.begin() as connection:
        connection.execute(update(EvaluationSchedule).where(EvaluationSchedule.id == schedule_id)
                           .values(next_fire_at=moment))


def _minute(minutes_ago: int) -> datetime:
    return (utcnow() - timedelta(minutes=minutes_ago)).replace(second=0, microsecond=0)


def _runs(engine: Engine, schedule_id: str) -> list[Evaluation]:
    with Session(engine) as session:
        stmt = select(Evaluation).where(Evaluation.schedule_id == schedule_id).order_by(Evaluation.fire_time)
        return list(session.scalars(stmt))


def test_two_racing_firers_queue_each_fire_time_once(committed: Engine) -> None:
    schedule_id = _schedule(committed)
    sessions = make_session_factory(committed)
    fire_time = _minute(10)
    created: list[list[str]] = []
    for _ in range(3):  # each round: two firers released at once on the same due schedule
        _due_at(committed, schedule_id, fire_time)
        barrier = threading.Barrier(2)

        def fire(barrier: threading.Barrier) -> None:
            barrier.wait()
            with session_scope(sessions) as session:
                created.append(evaluations.fire_due_schedules(session))

        threads = [threading.Thread(target=fire, args=(barrier,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    runs = _runs(committed, schedule_id)
    assert len(runs) == 1 and runs[0].fire_time == fire_time and runs[0].status == "queued"
    assert sorted(len(ids) for ids in created) == [0, 0, 0, 0, 0, 1]
    with Session(committed) as session:
        schedule = session.get(EvaluationSchedule, schedule_id)
        assert schedule is not None and schedule.next_fire_at > utcnow()  # moved past now, missed times skipped
        assert schedule.last_fire_at == fire_time


def test_not_due_fires_nothing_and_missed_times_collapse(committed: Engine) -> None:
    schedule_id = _schedule(committed, cron="*/5 * * * *")
    sessions = make_session_factory(committed)
    with session_scope(sessions) as session:
        assert evaluations.fire_due_schedules(session) == []  # its first time is in the future
    hour_ago = _minute(60)
    aligned = hour_ago.replace(minute=hour_ago.minute - hour_ago.minute % 5)
    _due_at(committed, schedule_id, aligned)  # twelve fire times were missed while beat was down
    with session_scope(sessions) as session:
        assert len(evaluations.fire_due_schedules(session)) == 1
    with session_scope(sessions) as session:
        assert evaluations.fire_due_schedules(session) == []
    assert [r.fire_time for r in _runs(committed, schedule_id)] == [aligned]


def test_runs_are_a_time_series_with_regression_flags(committed: Engine) -> None:
    schedule_id = _schedule(committed, margin=0.2)
    sessions = make_session_factory(committed)
    correct = {"n": 4}

    def reply(alias: str, request: LLMRequest) -> str:
        # the first `correct["n"]` reviews get their right label, the rest the wrong one
        index = int(str(request.prompt).split()[-1])
        right = "positive" if index % 2 == 0 else "negative"
        wrong = "negative" if right == "positive" else "positive"
        return right if index < correct["n"] else wrong

    lm = ScriptedLM(reply)
    scores = []
    for minutes_ago, n in ((30, 4), (20, 3), (10, 1)):  # scores 1.0, 0.75 (-0.25), 0.25 (-0.5)
        _due_at(committed, schedule_id, _minute(minutes_ago))
        with session_scope(sessions) as session:
            (evaluation_id,) = evaluations.fire_due_schedules(session)
        correct["n"] = n
        asyncio.run(EvaluationRun(evaluation_id, sessions, resources_for=lambda aliases: lm).run())
        scores.append(n / 4)
    with session_scope(sessions) as session:
        series = evaluations.schedule_runs(session, schedule_id)
    assert [run["score"] for run in series["data"]] == scores
    assert [run["regressed"] for run in series["data"]] == [False, True, True]
    assert [run["previous_score"] for run in series["data"]] == [None, 1.0, 0.75]
    assert series["regressions"] == 2 and series["margin"] == 0.2
    assert all(run["status"] == "completed" and run["parameter_version"] is None for run in series["data"])
    fire_times = [run["fire_time"] for run in series["data"]]
    assert fire_times == sorted(fire_times)


def test_within_the_margin_is_not_a_regression(committed: Engine) -> None:
    schedule_id = _schedule(committed, margin=0.3)
    sessions = make_session_factory(committed)
    with session_scope(sessions) as session:
        for minutes_ago, score in ((3, 0.9), (2, None), (1, 0.65)):
            _insert_run(session, schedule_id, _minute(minutes_ago), score)
    with session_scope(sessions) as session:
        series = evaluations.schedule_runs(session, schedule_id)
    assert [run["regressed"] for run in series["data"]] == [False, None, False]  # 0.9 → 0.65 is within 0.3


def _insert_run(session: Any, schedule_id: str, fire_time: datetime, score: float | None) -> None:
    schedule = session.get(EvaluationSchedule, schedule_id)
    row = Evaluation(
        id=f"eval_{fire_time.timestamp():.0f}_{schedule_id[-6:]}", pipeline_id=schedule.pipeline_id,
        pipeline_name="sentiment", owner="anonymous", status="completed" if score is not None else "failed",
        request=schedule.request, schedule_id=schedule_id, fire_time=fire_time.astimezone(UTC), score=score,
        total_examples=4, completed_examples=4, attempts=1,
    )
    session.add(row)
    session.flush()
    assert session.scalar(select(func.count()).select_from(Evaluation).where(Evaluation.id == row.id)) == 1
