"""`inf-engine train` and `inf-engine eval` against a real server (uvicorn on 127.0.0.1) backed by PostgreSQL,
with a scripted LM behind the pipeline and the optimizer."""

from __future__ import annotations

import json
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
from tests.support.training import DATASET, GOOD_PROMPT, scripted

__all__ = ["committed", "pg_engine", "pg_url"]  # fixtures

KEY = "sk-cli-learning"
runner = CliRunner()


@pytest.fixture
def server(committed: Engine) -> Iterator[ServerThread]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05)
    application = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=ScriptedLM(scripted)))
    with ServerThread(application) as thread:
        yield thread


def _cli(server: ServerThread, *args: str) -> Any:
    return runner.invoke(app, [*args, "--url", server.root, "--api-key", KEY])


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(example) + "\n" for example in DATASET))
    return path


def _get(server: ServerThread, path: str) -> Any:
    return httpx.get(f"{server.base_url}{path}", headers={"Authorization": f"Bearer {KEY}"}).json()


def test_train_then_eval_from_the_command_line(server: ServerThread, dataset: Path) -> None:
    trained = _cli(server, "train", "sentiment", "--dataset", str(dataset), "--eval-dataset", str(dataset),
                   "--metric", "exact", "--epochs", "1", "--batch-size", "2", "--seed", "0",
                   "--optimizer", '{"type": "sfa"}')
    assert trained.exit_code == 0, trained.output
    training_id = trained.stdout.strip()
    assert training_id.startswith("train_")
    # the progress bar and the summary go to stderr: 2 of 2 steps, the versions, the held-out scores
    assert "2/2" in trained.stderr and "completed, versions 1 → 2 (active)" in trained.stderr
    assert "held-out 0.000 → 1.000" in trained.stderr
    versions = _get(server, "/pipelines/sentiment/parameters/versions")
    assert versions["active_version"] == 2 and versions["data"][1]["state"]["classify.system_prompt"] == GOOD_PROMPT
    assert versions["data"][1]["score"] == 1.0  # the epoch's held-out score, on the version it produced

    evaluated = _cli(server, "eval", "sentiment", "--dataset", str(dataset), "--metric", "exact", "--version", "1")
    assert evaluated.exit_code == 0, evaluated.output
    assert evaluated.stdout.strip().startswith("eval_")
    assert "4/4" in evaluated.stderr and "score 0.000 (parameter version 1)" in evaluated.stderr

    loss = json.dumps({"type": "verifier", "check": "contains"})
    scheduled = _cli(server, "eval", "sentiment", "--dataset", str(dataset), "--loss", loss,
                     "--schedule", "0 3 * * *", "--margin", "0.05")
    assert scheduled.exit_code == 0, scheduled.output
    schedule = _get(server, f"/evaluations/schedules/{scheduled.stdout.strip()}")
    assert schedule["cron"] == "0 3 * * *" and schedule["margin"] == 0.05 and schedule["loss"]["check"] == "contains"


def test_bad_input_is_one_line(server: ServerThread, dataset: Path, tmp_path: Path) -> None:
    missing = _cli(server, "train", "sentiment", "--dataset", str(tmp_path / "none.jsonl"), "--metric", "exact")
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    both = _cli(server, "eval", "sentiment", "--dataset", str(dataset))
    assert both.exit_code == 2 and "--loss" in both.stderr
    refused = _cli(server, "train", "sentiment", "--dataset", str(dataset), "--loss", '{"type": "magic"}')
    assert refused.exit_code == 2 and "HTTP 400" in refused.stderr and "loss.type must be one of" in refused.stderr
