"""The Celery configuration, beat schedule, CLI queue selection and the engine host (no broker needed)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.cli.workers import worker_queues
from app.settings import Settings
from workers.beat import beat_schedule
from workers.celery_app import create_celery_app, require_redis
from workers.engine_host import LoopHost


def _settings(**overrides: object) -> Settings:
    return Settings(redis_url="redis://127.0.0.1:6379/0", **overrides)  # type: ignore[arg-type]


def test_delivery_is_at_least_once_and_bounded() -> None:
    conf = create_celery_app(_settings(celery_task_time_limit=600, celery_visibility_timeout=900)).conf
    assert conf.task_acks_late is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_reject_on_worker_lost is True
    assert conf.task_time_limit == 600
    assert conf.task_soft_time_limit == 540
    options = conf.broker_transport_options
    assert options["visibility_timeout"] == 900 > conf.task_time_limit
    assert options["queue_order_strategy"] == "priority"
    assert options["priority_steps"] == list(range(10))


def test_keys_and_queues_follow_the_prefixes() -> None:
    conf = create_celery_app(_settings(redis_prefix="p1", celery_queue_prefix="q1")).conf
    assert conf.broker_transport_options["global_keyprefix"] == "p1:celery:"
    assert conf.result_backend_transport_options["global_keyprefix"] == "p1:celery:"
    assert [q.name for q in conf.task_queues] == ["q1.cpu", "q1.llm", "q1.engine"]
    assert conf.task_default_queue == "q1.cpu"
    assert conf.broker_url == "redis://127.0.0.1:6379/0"
    assert conf.task_ignore_result is True
    assert conf.worker_send_task_events  # what Flower shows
    assert not conf.task_send_sent_event  # a publish per send, on the workers' hot path


def test_task_events_can_be_switched_off() -> None:
    conf = create_celery_app(_settings(celery_task_events=False)).conf
    assert not conf.worker_send_task_events


def test_visibility_timeout_must_exceed_the_task_time_limit() -> None:
    with pytest.raises(ValueError, match="celery_visibility_timeout"):
        _settings(celery_task_time_limit=600, celery_visibility_timeout=600)


def test_without_redis_the_error_says_what_to_set() -> None:
    with pytest.raises(RuntimeError, match="INF_ENGINE_REDIS_URL"):
        require_redis(Settings(redis_url=None))


def test_beat_schedule_runs_the_heartbeat_on_the_cpu_queue() -> None:
    schedule = beat_schedule(_settings(celery_queue_prefix="q2"))
    entry = schedule["beat-heartbeat"]
    assert entry["task"] == "inf.beat_heartbeat"
    assert entry["options"] == {"queue": "q2.cpu", "expires": entry["schedule"]}


@pytest.mark.parametrize(
    ("requested", "engine", "expected"),
    [
        (None, False, ["x.cpu", "x.llm"]),
        (None, True, ["x.engine"]),
        (["cpu"], False, ["x.cpu"]),
        (["llm,cpu", "cpu"], False, ["x.llm", "x.cpu"]),
        (["cpu"], True, ["x.cpu", "x.engine"]),
        (["custom.queue"], False, ["custom.queue"]),
    ],
)
def test_worker_queues(requested: list[str] | None, engine: bool, expected: list[str]) -> None:
    assert worker_queues(requested, engine, "x") == expected


def test_the_engine_host_runs_every_task_thread_on_one_loop() -> None:
    host = LoopHost()
    loops: set[int] = set()

    async def call() -> int:
        loops.add(id(asyncio.get_running_loop()))
        await asyncio.sleep(0.2)  # an engine request in flight
        return threading.get_ident()

    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(host.run(call()))) for _ in range(32)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    host.stop()
    assert len(results) == 32 and len(loops) == 1  # one loop, so one engine sees all 32 at once
    assert elapsed < 0.2 * 32 / 3  # together, not one by one


def test_the_engine_host_cancels_on_timeout() -> None:
    host = LoopHost()
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="did not finish"):
        host.run(slow(), timeout=0.1)
    assert cancelled.wait(2)
    host.stop()
