"""Issue 17 on real processes: workers announce their queues (/health and beat's watch read them), workers and
beat write the one JSON log format with task and job ids, and beat's liveness is its own heartbeat."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.main import create_app
from app.jobs.distributed.presence import WorkerPresence, platform_health
from app.settings import Settings
from tests.integration.workers.conftest import ROOT, Platform, wait_until
from tests.support.redisdb import SERVER, client
from tests.support.serving_fakes import FakeBackend
from workers.beat import SweeperWatch, heartbeat_file
from workers.celery_app import create_celery_app


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _settings(platform: Platform) -> Settings:
    return Settings(redis_url=SERVER, redis_prefix=platform.prefix, celery_queue_prefix=platform.prefix)


def test_no_worker_on_the_sweepers_queue_is_reported_then_cleared(platform: Platform) -> None:
    presence = WorkerPresence(client(), platform.prefix)
    settings = _settings(platform)
    with TestClient(create_app(settings, backend=FakeBackend())) as api:
        llm_only = platform.start("worker", "--queues", "llm", "--pool", "threads", "--name", f"llm.{platform.prefix}@h")
        wait_until(lambda: presence.workers(), 60, "the llm worker's announcement")
        health = api.get("/health").json()
        assert health["status"] == "ok"  # reported, not failed on: only a worker can fix it
        platform_part = health["platform"]
        assert platform_part["status"] == "degraded"
        assert platform_part["consumers"][f"{platform.prefix}.cpu"] == []
        assert f"no worker consumes the queue {platform.prefix}.cpu" in platform_part["problems"][0]

        watch = SweeperWatch(presence, platform.prefix, every_s=0.0)
        assert watch.check() == platform_part["problems"]
        # the worker itself warned that it leaves the sweeper's queue alone
        assert any("sweeper" in line["msg"] and line["level"] == "WARNING"
                   for line in _json_lines(platform.log_of(llm_only)))

        platform.start("worker", "--pool", "threads", "--name", f"cpu.{platform.prefix}@h")
        wait_until(lambda: api.get("/health").json()["platform"]["status"] == "ok", 60, "the cpu worker")
        assert watch.check() == []
        consumers = api.get("/health").json()["platform"]["consumers"]
        assert consumers[f"{platform.prefix}.cpu"] == [f"cpu.{platform.prefix}@h"]

        platform.stop(llm_only)  # a warm shutdown withdraws its announcement
        wait_until(lambda: f"llm.{platform.prefix}@h" not in presence.workers(), 30, "the withdrawal")
    assert platform_health(presence, platform.prefix).ok


def test_worker_logs_are_json_with_task_and_job_ids(platform: Platform) -> None:
    name = f"log.{platform.prefix}@h"
    worker = platform.start("worker", "--pool", "threads", "--name", name, "--loglevel", "DEBUG")
    celery = create_celery_app(platform.settings)
    try:
        wait_until(lambda: celery.control.ping(destination=[name], timeout=1.0), 60, "the worker")
        result = celery.send_task("inf.ping", args=["x"], kwargs={}, queue=f"{platform.prefix}.cpu")
        assert result.get(timeout=30) == "x"
        # a node task of a job that does not exist: it logs inside the task, with the job id bound
        celery.send_task("inf.run_node", args=["job_missing17", 1, "n0", 1], queue=f"{platform.prefix}.cpu")

        def task_lines() -> list[dict[str, Any]]:
            lines = _json_lines(platform.log_of(worker))
            return [line for line in lines if line.get("job_id") == "job_missing17"]

        lines = wait_until(task_lines, 30, "a log line of the node task")
    finally:
        celery.close()
    all_lines = _json_lines(platform.log_of(worker))
    assert all_lines and {line["service"] for line in all_lines} == {"worker"}
    for line in all_lines:
        assert {"ts", "level", "logger", "msg", "request_id", "task_id", "job_id"} <= set(line)
    assert all(line["task_id"] for line in lines)
    text_lines = [line for line in platform.log_of(worker).splitlines() if line.startswith("[20")]
    assert not text_lines, text_lines[:3]  # none of Celery's own text format


def test_beat_logs_json_and_its_liveness_is_its_heartbeat(platform: Platform, tmp_path: Path) -> None:
    check = [sys.executable, "-m", "app.cli", "beat", "--check"]

    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run(check, cwd=ROOT, env=platform.env, capture_output=True, text=True, timeout=60)

    before = probe()
    assert before.returncode == 1 and "has not beaten" in before.stderr
    beat = platform.start("beat")
    path = heartbeat_file(Settings(data_dir=Path(platform.env["INF_ENGINE_DATA_DIR"])))
    wait_until(path.exists, 60, "beat's heartbeat file")
    alive = probe()
    assert alive.returncode == 0, alive.stderr
    assert "beat alive" in alive.stdout
    platform.stop(beat)
    old = time.time() - 600
    import os

    os.utime(path, (old, old))
    stale = probe()
    assert stale.returncode == 1 and "old" in stale.stderr
    lines = _json_lines(platform.log_of(beat))
    assert lines and {line["service"] for line in lines} == {"beat"}
    assert any("beat" in line["msg"].lower() for line in lines)
