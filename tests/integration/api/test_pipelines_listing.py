"""``GET /v1/pipelines``: the registered pipelines, each with the caller's active parameter version and how many
versions it has (the console's navigation); tenants see only their own versions."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.main import create_app
from app.db import repository
from app.jobs.registry import current_registry
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.training import DATASET, scripted

ACME, GLOBEX = {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer sk-globex"}


def _by_name(client: TestClient, headers: dict[str, str]) -> dict[str, dict[str, Any]]:
    response = client.get("/v1/pipelines", headers=headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return {view["name"]: view for view in body["data"]}


def test_pipelines_with_each_tenants_versions(tmp_path: Path) -> None:
    config = Settings(data_dir=tmp_path / "state", jobs_poll_interval=0.05,
                      api_keys=["acme:sk-acme", "globex:sk-globex"])
    app = create_app(config, jobs=JobsRuntime(config, resources=ScriptedLM(scripted)))
    with TestClient(app) as client:
        assert client.get("/v1/pipelines").status_code == 401
        before = _by_name(client, ACME)
        assert list(before) == current_registry().pipeline_names()  # every registered name, sorted
        assert {"sentiment", "review-compare"} <= set(before)
        assert before["sentiment"] == {"object": "pipeline", "name": "sentiment", "active_version": None,
                                       "versions": 0}
        made = client.post("/v1/trainings", json={"pipeline": "sentiment", "dataset": DATASET, "metric": "exact",
                                                  "batch_size": 4}, headers=ACME)
        assert made.status_code == 201, made.text
        for _ in range(300):
            if client.get(f"/v1/trainings/{made.json()['id']}", headers=ACME).json()["status"] == "completed":
                break
            time.sleep(0.05)
        acme = _by_name(client, ACME)
        assert acme["sentiment"]["active_version"] == 2 and acme["sentiment"]["versions"] == 2
        assert client.post("/v1/pipelines/sentiment/parameters/versions/1/activate",
                           headers=ACME).status_code == 200
        assert _by_name(client, ACME)["sentiment"]["active_version"] == 1
        assert _by_name(client, GLOBEX)["sentiment"] == before["sentiment"]  # globex has no versions


def test_version_counts_in_one_query_on_postgres(db: Session) -> None:
    first = repository.get_or_create_pipeline(db, owner="acme", name="app.examples.sentiment:SentimentLabel",
                                              import_path="app.examples.sentiment:SentimentLabel")
    repository.get_or_create_pipeline(db, owner="acme", name="app.examples.extract:Extract",
                                      import_path="app.examples.extract:Extract")
    repository.get_or_create_pipeline(db, owner="globex", name="app.examples.sentiment:SentimentLabel",
                                      import_path="app.examples.sentiment:SentimentLabel")
    for prompt in ("a", "b", "c"):
        repository.add_parameter_version(db, pipeline_id=first.id, state={"p": prompt})
    rows = [(row.name, row.parameter_version, count)
            for row, count in repository.pipelines_with_versions(db, owner="acme")]
    assert rows == [("app.examples.extract:Extract", 0, 0), ("app.examples.sentiment:SentimentLabel", 3, 3)]
