"""The embedded default: no database configured, so the first jobs request creates SQLite in data_dir; a
restarted app resumes from that file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.main import create_app
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend


def _app(data_dir: Path, lm: ScriptedLM) -> Any:
    config = Settings(data_dir=data_dir, jobs_poll_interval=0.05)
    return create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=lm))


def test_jobs_on_embedded_sqlite(tmp_path: Path) -> None:
    data_dir = tmp_path / "state"
    with TestClient(_app(data_dir, ScriptedLM())) as client:
        assert client.get("/v1/models").status_code == 200
        assert not (data_dir / "inf-engine.db").exists()  # nothing is created until jobs are used
        inputs = [{"custom_id": f"q{i}", "input": f"review {i}"} for i in range(8)]
        job = client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": inputs})
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        for _ in range(200):
            view = client.get(f"/v1/jobs/{job_id}").json()
            if view["status"] == "completed":
                break
            time.sleep(0.05)
        assert view["status"] == "completed" and view["counts"]["completed"] == 8
        assert (data_dir / "inf-engine.db").exists()
    # a new app on the same data_dir starts the runtime at boot (the file exists) and still has the job
    with TestClient(_app(data_dir, ScriptedLM())) as client:
        lines = client.get(f"/v1/jobs/{job_id}/results").text.splitlines()
        assert len(lines) == 8
        assert client.app.state.jobs.executor is not None  # type: ignore[attr-defined]


def test_without_resources_jobs_use_the_servers_own_backend(tmp_path: Path) -> None:
    backend = FakeBackend()
    config = Settings(data_dir=tmp_path / "state", jobs_poll_interval=0.05)
    with TestClient(create_app(config, backend=backend)) as client:
        job = client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": ["great phone, bad battery"]})
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        for _ in range(200):
            view = client.get(f"/v1/jobs/{job_id}").json()
            if view["status"] in {"completed", "failed"}:
                break
            time.sleep(0.05)
        assert view["status"] == "completed", view
        (line,) = [json.loads(x) for x in client.get(f"/v1/jobs/{job_id}/results").text.splitlines()]
    assert line["output"]["liked"].startswith("echo: ")  # FakeBackend's answer
    assert len(backend.requests) == 3  # three LLM nodes, all on the server's backend
