"""Real workers, Flower and beat, started with the ``inf-engine`` commands, on the loopback Redis."""

from __future__ import annotations

import signal
import socket
from datetime import datetime
from typing import Any

import httpx

from tests.integration.workers.conftest import Platform, free_port, wait_until
from tests.support.redisdb import client
from workers.beat import lock_key
from workers.celery_app import create_celery_app

AUTH = ("tester", "s3cret:pw")


def test_flower_shows_the_worker_and_its_tasks(platform: Platform) -> None:
    port = free_port()
    flower = platform.start("flower", "--port", str(port))
    name = f"cpu.{platform.prefix}@localhost"
    platform.start("worker", "--concurrency", "2", "--name", name)
    base = f"http://127.0.0.1:{port}"
    wait_until(
        lambda: httpx.get(f"{base}/api/workers", auth=AUTH, timeout=5).status_code == 200, 60, "Flower"
    )
    assert httpx.get(f"{base}/api/workers", timeout=5).status_code == 401  # basic auth from settings
    assert httpx.get(f"{base}/healthcheck", timeout=5).text == "OK"  # the probe's path stays open
    assert httpx.get(f"{base}/api/tasks", auth=("tester", "wrong"), timeout=5).status_code == 401

    celery = create_celery_app(platform.settings)
    try:
        wait_until(lambda: celery.control.ping(destination=[name], timeout=1.0), 60, "the worker")
        queue = f"{platform.prefix}.cpu"
        sent = [celery.send_task("inf.ping", args=[i], queue=queue) for i in range(5)]
        assert [r.get(timeout=30) for r in sent] == list(range(5))
        ids = {r.id for r in sent}

        def tasks_seen() -> dict[str, Any] | None:
            tasks = httpx.get(f"{base}/api/tasks", auth=AUTH, timeout=5).json()
            mine = {k: v for k, v in tasks.items() if k in ids}
            return mine if len(mine) == 5 and all(t["state"] == "SUCCESS" for t in mine.values()) else None

        tasks = wait_until(tasks_seen, 30, "the tasks in Flower")
        assert {t["name"] for t in tasks.values()} == {"inf.ping"}
        assert {t["worker"] for t in tasks.values()} == {name}

        workers = wait_until(
            lambda: httpx.get(f"{base}/api/workers", params={"refresh": 1}, auth=AUTH, timeout=10).json(),
            30,
            "the worker in Flower",
        )
        assert name in workers
        queues = {q["name"] for q in workers[name]["active_queues"]}
        assert queues == {queue, f"{platform.prefix}.llm"}
        assert workers[name]["stats"]["pool"]["max-concurrency"] == 2
    finally:
        celery.close()
    assert flower.poll() is None, platform.log_of(flower)


def test_engine_worker_consumes_the_engine_queue_on_threads(platform: Platform) -> None:
    # the node name from settings, with %h expanded as Celery does (what the deployment's probes rely on)
    platform.env["INF_ENGINE_WORKER_NAME"] = f"engine.{platform.prefix}@%h"
    name = f"engine.{platform.prefix}@{socket.gethostname()}"
    worker = platform.start("worker", "--engine", "--concurrency", "4")
    celery = create_celery_app(platform.settings)
    try:
        wait_until(lambda: celery.control.ping(destination=[name], timeout=1.0), 60, "the engine worker")
        inspect = celery.control.inspect(destination=[name], timeout=5)
        queues = [q["name"] for q in inspect.active_queues()[name]]
        assert queues == [f"{platform.prefix}.engine"]
        pool = inspect.stats()[name]["pool"]
        assert pool["max-concurrency"] == 4
        assert "thread" in pool["implementation"]  # one process: one engine shared by the task threads
        result = celery.send_task("inf.ping", args=["engine"], queue=f"{platform.prefix}.engine")
        assert result.get(timeout=30) == "engine"
    finally:
        celery.close()
    assert worker.poll() is None, platform.log_of(worker)


def test_lower_priority_numbers_run_first_on_redis(platform: Platform) -> None:
    queue = f"{platform.prefix}.prio"
    celery = create_celery_app(platform.settings)
    try:
        priorities = [9, 3, 6, 0, 8, 1]
        # enqueued while no worker listens, so the order of execution is the broker's order
        sent = [celery.send_task("inf.ping", args=[p], queue=queue, priority=p) for p in priorities]
        platform.start(
            "worker", "--queues", queue, "--pool", "solo", "--name", f"prio.{platform.prefix}@localhost"
        )
        for r in sent:
            r.get(timeout=60)
        done: list[tuple[datetime, int]] = [(r.date_done, r.result) for r in sent]
        assert [p for _, p in sorted(done)] == sorted(priorities)
    finally:
        celery.close()


def test_only_one_beat_runs_and_a_standby_takes_over(platform: Platform) -> None:
    platform.env["INF_ENGINE_BEAT_LOCK_TTL"] = "2"
    first = platform.start("beat")
    wait_until(lambda: "starting beat" in platform.log_of(first), 30, "the first beat")
    second = platform.start("beat")
    wait_until(lambda: "standing by" in platform.log_of(second), 30, "the standby beat")
    assert "starting beat" not in platform.log_of(second)
    redis = client()
    holder = redis.get(lock_key(platform.settings))
    platform.stop(first, signal.SIGKILL)  # dies holding the lock: it expires after the TTL
    wait_until(lambda: "beat: Starting" in platform.log_of(second), 15, "the standby to take over")
    assert redis.get(lock_key(platform.settings)) not in (None, holder)
    platform.stop(second)  # a clean stop frees the lock at once
    assert redis.get(lock_key(platform.settings)) is None
    redis.close()
