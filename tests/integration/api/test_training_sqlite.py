"""Trainings and evaluations on the embedded default: SQLite in data_dir, and the server's own backend for every
alias (pipeline, optimizer) when no resources file is configured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.main import create_app
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend
from tests.support.training import DATASET, GOOD_PROMPT, scripted


def _wait(client: TestClient, path: str) -> dict[str, Any]:
    for _ in range(300):
        view = client.get(path).json()
        if view["status"] in {"completed", "failed", "cancelled"}:
            return view
        time.sleep(0.05)
    raise AssertionError(f"{path} did not finish: {view}")


def test_training_and_evaluation_on_sqlite(tmp_path: Path) -> None:
    config = Settings(data_dir=tmp_path / "state", jobs_poll_interval=0.05)
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=ScriptedLM(scripted)))
    with TestClient(app) as client:
        created = client.post("/v1/trainings", json={"pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "optimizer": "sfa",
                                                      "batch_size": 4})
        assert created.status_code == 201, created.text
        done = _wait(client, f"/v1/trainings/{created.json()['id']}")
        assert done["status"] == "completed" and done["final_version"] == 2
        versions = client.get("/v1/pipelines/sentiment/parameters/versions").json()
        assert versions["data"][-1]["state"] == {"classify.system_prompt": GOOD_PROMPT}

        schedule = client.post("/v1/evaluations/schedules", json={
            "pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "cron": "@daily", "margin": 0.1})
        assert schedule.status_code == 201, schedule.text
        assert schedule.json()["cron"] == "0 0 * * *"
        runs = client.get(f"/v1/evaluations/schedules/{schedule.json()['id']}/runs").json()
        assert runs["data"] == [] and runs["regressions"] == 0

        evaluation = client.post("/v1/evaluations", json={"pipeline": "sentiment", "dataset": DATASET,
                                                          "metric": "exact"})
        assert _wait(client, f"/v1/evaluations/{evaluation.json()['id']}")["score"] == 1.0


def test_without_resources_training_uses_the_servers_backend(tmp_path: Path) -> None:
    backend = FakeBackend()  # answers "echo: <prompt>" for the pipeline, the aggregator and the updater alike
    config = Settings(data_dir=tmp_path / "state", jobs_poll_interval=0.05)
    with TestClient(create_app(config, backend=backend)) as client:
        created = client.post("/v1/trainings", json={"pipeline": "sentiment", "dataset": DATASET[:2], "optimizer": "sfa",
                                                      "metric": "exact", "batch_size": 2})
        assert created.status_code == 201, created.text
        done = _wait(client, f"/v1/trainings/{created.json()['id']}")
    assert done["status"] == "completed", done
    (step,) = done["steps"]
    assert step["score"] == 0.0 and step["version"] == 2
    (update,) = step["updates"]
    assert update["new_value"].startswith("echo: ")  # the updater's answer came from the server's backend
    # two classifications, one aggregation of their feedback, one update: all on the one backend
    assert len(backend.requests) == 4


def test_a_request_names_a_shipped_dataset(tmp_path: Path) -> None:
    from app.examples.datasets import load_split

    truth = {e["input"]: e["target"] for e in load_split("sentiment", "validation")}
    lm = ScriptedLM(lambda alias, request: truth.get(str(request.prompt), "positive"))
    config = Settings(data_dir=tmp_path / "state", jobs_poll_interval=0.05)
    with TestClient(create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=lm))) as client:
        evaluation = client.post("/v1/evaluations", json={"pipeline": "sentiment", "dataset": "sentiment:validation",
                                                          "metric": "exact"})
        assert evaluation.status_code == 201, evaluation.text
        assert _wait(client, f"/v1/evaluations/{evaluation.json()['id']}")["score"] == 1.0
        assert len(lm.calls) == 80
        refused = client.post("/v1/evaluations", json={"pipeline": "sentiment", "dataset": "../reviews.jsonl",
                                                       "metric": "exact"})
        assert refused.status_code == 400 and "registered dataset" in refused.json()["error"]["message"]
