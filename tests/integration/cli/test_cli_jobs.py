"""`inf-engine submit / jobs / results` against a real server (uvicorn on 127.0.0.1) backed by PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from typer.testing import CliRunner

from api.main import create_app
from app.cli import app
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.postgres import committed, pg_engine, pg_url
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend

__all__ = ["committed", "pg_engine", "pg_url"]  # fixtures

KEY = "sk-cli"
runner = CliRunner()


@pytest.fixture
def server(committed: Engine) -> Iterator[ServerThread]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05)
    application = create_app(config, backend=FakeBackend(),
                             jobs=JobsRuntime(config, resources=ScriptedLM(latency=0.02)))
    with ServerThread(application) as thread:
        yield thread


def _cli(server: ServerThread, *args: str) -> Any:
    return runner.invoke(app, [*args, "--url", server.root, "--api-key", KEY])


@pytest.fixture
def reviews(tmp_path: Path) -> Path:
    path = tmp_path / "reviews.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "input": {"review": f"text {i}"}}) + "\n"
                            for i in range(4)))
    return path


def _wait(server: ServerThread, job_id: str) -> dict[str, Any]:
    for _ in range(200):
        job = httpx.get(f"{server.base_url}/jobs/{job_id}", headers={"Authorization": f"Bearer {KEY}"}).json()
        if job["status"] in {"completed", "failed", "cancelled"}:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def test_submit_jobs_results(server: ServerThread, reviews: Path, tmp_path: Path) -> None:
    submitted = _cli(server, "submit", "review-compare", "--input", str(reviews), "--priority", "1")
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.stdout.strip()
    assert job_id.startswith("job_")
    assert _wait(server, job_id)["status"] == "completed"

    listing = _cli(server, "jobs")
    assert listing.exit_code == 0 and job_id in listing.stdout and "completed" in listing.stdout
    as_json = _cli(server, "jobs", "--json", "--status", "completed")
    assert [j["id"] for j in json.loads(as_json.stdout)["data"]] == [job_id]

    results = _cli(server, "results", job_id)
    assert results.exit_code == 0, results.output
    lines = [json.loads(line) for line in results.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["custom_id"] for line in lines) == ["c0", "c1", "c2", "c3"]
    assert all(line["status"] == "completed" for line in lines)
    out = tmp_path / "rest.jsonl"
    rest = _cli(server, "results", job_id, "--cursor", "3", "--output", str(out))
    assert rest.exit_code == 0 and [json.loads(x) for x in out.read_text().splitlines()] == lines[3:]


def test_submit_follow_streams_every_result(server: ServerThread, reviews: Path) -> None:
    result = _cli(server, "submit", "review-compare", "--input", str(reviews), "--follow")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["custom_id"] for line in lines) == ["c0", "c1", "c2", "c3"]
    assert "4/4 completed" in result.stderr


def test_errors_are_one_line(server: ServerThread, reviews: Path, tmp_path: Path) -> None:
    unknown = _cli(server, "submit", "no.such:Pipeline", "--input", str(reviews))
    assert unknown.exit_code == 2 and "HTTP 400" in unknown.stderr and "unknown pipeline" in unknown.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a"}\n{nope\n')
    line = _cli(server, "submit", "review-compare", "--input", str(bad))
    assert line.exit_code == 2 and "line 2" in line.stderr
    missing = _cli(server, "submit", "review-compare", "--input", str(tmp_path / "none.jsonl"))
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    nojob = _cli(server, "results", "job_unknown")
    assert nojob.exit_code == 2 and "HTTP 404" in nojob.stderr
    no_key = runner.invoke(app, ["jobs", "--url", server.root, "--api-key", "wrong"])
    assert no_key.exit_code == 2 and "401" in no_key.stderr and "API_KEY" in no_key.stderr
    down = runner.invoke(app, ["jobs", "--url", "http://127.0.0.1:9"])
    assert down.exit_code == 1 and "cannot reach" in down.stderr
