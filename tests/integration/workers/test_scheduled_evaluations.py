"""Scheduled evaluations end to end on real processes: two ``inf-engine beat`` (one holds the lock, one stands by),
an ``inf-engine worker``, PostgreSQL, Redis and a fake OpenAI endpoint. Each (schedule, fire time) is evaluated
exactly once, also after the lock changes hands and when a fire time comes due again."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from app.db import create_db_engine, make_session_factory, session_scope, utcnow
from app.db.migrate import upgrade
from app.db.optimization_models import Evaluation, EvaluationSchedule
from app.jobs.learning import evaluations
from app.jobs.learning.evaluations import EvaluationRequest
from app.testing.fake_llm_server import FakeLLMServer
from tests.integration.workers.conftest import Platform, wait_until
from tests.support.postgres import temporary_database

DATASET = [{"input": f"review {i}", "target": "positive" if i < 3 else "negative"} for i in range(4)]


@pytest.fixture
def database() -> Iterator[Engine]:
    with temporary_database("infe_sched") as url:
        upgrade(url)
        engine = create_db_engine(url)
        yield engine
        engine.dispose()


def _runs(engine: Engine, schedule_id: str) -> list[Evaluation]:
    with Session(engine) as session:
        stmt = select(Evaluation).where(Evaluation.schedule_id == schedule_id).order_by(Evaluation.fire_time)
        return list(session.scalars(stmt))


def _completed(engine: Engine, schedule_id: str, fire_time: object) -> bool:
    return any(r.fire_time == fire_time and r.status == "completed" for r in _runs(engine, schedule_id))


def _due_at(engine: Engine, schedule_id: str, minutes_ago: int) -> object:
    moment = (utcnow() - timedelta(minutes=minutes_ago)).replace(second=0, microsecond=0)
    with engine.begin() as connection:
        connection.execute(update(EvaluationSchedule).where(EvaluationSchedule.id == schedule_id)
                           .values(next_fire_at=moment))
    return moment


def test_beat_twice_fires_each_schedule_time_once(platform: Platform, database: Engine, tmp_path: Path) -> None:
    with FakeLLMServer(reply="positive") as endpoint:
        resources = tmp_path / "resources.toml"
        resources.write_text(f'[endpoints.assistant]\nprovider = "openai"\nmodel = "m"\n'
                             f'base_url = "{endpoint.base_url}"\napi_key = "sk-test"\n')
        platform.env.update({
            "INF_ENGINE_DATABASE_URL": database.url.render_as_string(hide_password=False),
            "INF_ENGINE_RESOURCES_FILE": str(resources),
            "INF_ENGINE_EVALUATION_SCHEDULE_INTERVAL": "1",
            "INF_ENGINE_BEAT_LOCK_TTL": "2",
        })
        with session_scope(make_session_factory(database)) as session:
            schedule_id = evaluations.create_schedule(
                session, EvaluationRequest(pipeline="sentiment", dataset=DATASET, metric="exact"),
                cron="* * * * *", margin=0.1,
            ).id
        first_time = _due_at(database, schedule_id, 30)

        platform.start("worker", "--queues", "cpu,llm", "--concurrency", "2")
        first = platform.start("beat")
        wait_until(lambda: "starting beat" in platform.log_of(first), 30, "the first beat")
        second = platform.start("beat")
        wait_until(lambda: "standing by" in platform.log_of(second), 30, "the standby beat")
        wait_until(lambda: _completed(database, schedule_id, first_time), 60,
                   "the first fire time to be evaluated by the worker")

        # the lock changes hands: the standby fires the next due time, and a time fired before stays single
        platform.stop(first, signal.SIGKILL)
        wait_until(lambda: "beat: Starting" in platform.log_of(second), 20, "the standby to take over")
        second_time = _due_at(database, schedule_id, 20)
        wait_until(lambda: _completed(database, schedule_id, second_time), 60, "the second fire time")
        _due_at(database, schedule_id, 30)  # the first time is due again: firing it must be a no-op
        wait_until(lambda: _fired_past(database, schedule_id), 20, "beat to look at the schedule again")

        runs = _runs(database, schedule_id)
        fire_times = [r.fire_time for r in runs]
        assert len(fire_times) == len(set(fire_times)) and {first_time, second_time} <= set(fire_times)
        done = [r for r in runs if r.status == "completed"]
        assert all(r.score == 0.75 and r.attempts == 1 for r in done)  # three of four targets are "positive"
        # every evaluation ran exactly once: the endpoint saw each example once per completed run
        assert endpoint.stats()["total"] == len(DATASET) * len(done)
        assert not any(r.status in ("failed", "cancelled") for r in runs)
        with session_scope(make_session_factory(database)) as session:
            series = evaluations.schedule_runs(session, schedule_id)
        assert [run["regressed"] for run in series["data"] if run["score"] is not None] == [False] * len(done)


def _fired_past(engine: Engine, schedule_id: str) -> bool:
    """True once beat has moved the schedule on again (its next time is in the future)."""
    with Session(engine) as session:
        schedule = session.get(EvaluationSchedule, schedule_id)
        assert schedule is not None
        next_fire = schedule.next_fire_at
        return next_fire > utcnow()
