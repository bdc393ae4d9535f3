"""The Celery dispatcher's pure parts: where a queue's messages live in Redis, and the beat's sweeper entry."""

from __future__ import annotations

from app.jobs.distributed.transport.celery_dispatch import queue_keys
from app.settings import Settings
from workers.beat import beat_schedule, periodic_tasks


def test_a_queue_is_one_redis_list_per_priority_level_under_the_celery_prefix() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix="p1")
    keys = queue_keys(settings, "p1.llm")
    assert keys[0] == "p1:celery:p1.llm"  # level 0 under the queue's own name
    assert keys[1:] == [f"p1:celery:p1.llm:{level}" for level in range(1, 10)]


def test_beat_runs_the_sweeper_at_the_configured_interval() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:6379/0", sweep_interval=2.5, celery_queue_prefix="q3")
    assert any(p.task == "inf.sweep" and p.every_s == 2.5 for p in periodic_tasks(settings))
    entry = beat_schedule(settings)["sweeper"]
    assert entry["task"] == "inf.sweep"
    assert entry["options"] == {"queue": "q3.cpu", "expires": 2.5}  # a missed sweep is dropped, not stacked
