"""The default training (the selection-gated gepa optimizer) over HTTP on PostgreSQL, with a scripted LM: every
candidate is history in GET /v1/trainings/{id}, the best by validation score is activated, an older version can be
activated again, and the request's new fields are checked with 400s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from api.main import create_app
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend
from tests.support.training import FEWSHOT_TRAIN, FEWSHOT_VALIDATION, WEAK_PROMPT, scripted_fewshot

KEY = "sk-gepa-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Client:
    def __init__(self, client: TestClient, lm: ScriptedLM) -> None:
        self.client, self.lm = client, lm

    def post(self, path: str, body: dict[str, Any], status: int = 201) -> dict[str, Any]:
        response = self.client.post(path, json=body, headers=AUTH)
        assert response.status_code == status, response.text
        return response.json()

    def get(self, path: str) -> dict[str, Any]:
        response = self.client.get(path, headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (view := self.get(path))["status"] not in {"completed", "failed", "cancelled"}:
            assert time.monotonic() < deadline, view
            time.sleep(0.05)
        return view


@pytest.fixture
def api(committed: Engine) -> Iterator[Client]:
    lm = ScriptedLM(scripted_fewshot)
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05, jobs_max_items=100)
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=lm))
    with TestClient(app) as client:
        yield Client(client, lm)


def test_the_default_training_keeps_every_candidate_and_activates_the_best_by_validation(api: Client) -> None:
    body = {"pipeline": "sentiment", "dataset": FEWSHOT_TRAIN, "validation_dataset": FEWSHOT_VALIDATION,
            "metric": "exact", "seed": 1, "optimizer": {"budget": 80, "minibatch_size": 4, "candidates_per_step": 3}}
    created = api.post("/v1/trainings", body)
    assert created["optimizer"]["type"] == "gepa" and created["optimizer"]["budget"] == 80
    done = api.wait(f"/v1/trainings/{created['id']}")
    assert done["status"] == "completed", done
    result = done["result"]
    assert result["optimizer"] == "gepa" and result["metric_calls"] <= 80 and result["stopped"] == "perfect"  # then it stops spending
    scores = result["val_scores"]
    assert scores[0] == 0.0 and scores[-1] == 1.0 and scores == sorted(scores)  # never falls

    candidates = done["candidates"]
    seed, children = candidates[0], candidates[1:]
    assert seed["kind"] == "seed" and seed["parent"] is None and seed["val_score"] == 0.0
    assert [c["id"] for c in candidates] == list(range(len(candidates))) and len(children) >= 3
    train_inputs = {e["input"] for e in FEWSHOT_TRAIN}
    for child in children:
        assert child["parent"] is not None and child["minibatch"] and child["note"]
        assert {d["input"] for d in child["state"]["classify.demos"]} <= train_inputs  # never validation
    rewrites = [c for c in children if c["kind"] == "instruction"]
    assert rewrites and all(not c["accepted"] and c["state"]["classify.system_prompt"] == WEAK_PROMPT
                            for c in rewrites)  # a rewrite that does not help is history, not the prompt
    (best,) = [c for c in children if c["best"]]
    assert best["accepted"] and best["kind"] == "demos" and best["val_score"] == 1.0
    assert best["gain"] > best["noise"] and best["minibatch_score"] == 1.0

    versions = api.get("/v1/pipelines/sentiment/parameters/versions")
    assert versions["active_version"] == done["final_version"] == 2 and done["base_version"] == 1
    trained = versions["data"][-1]
    assert trained["state"]["classify.demos"] == best["state"]["classify.demos"] and trained["score"] == 1.0
    assert [s["version"] for s in done["steps"] if s["version"] is not None] == [2]

    # rollback: version 1 (no demonstrations) is active again and a job runs without them
    api.post("/v1/pipelines/sentiment/parameters/versions/1/activate", {}, status=200)
    api.lm.calls.clear()
    job = api.post("/v1/jobs", {"pipeline": "sentiment", "inputs": ["Great value"]})
    assert api.wait(f"/v1/jobs/{job['id']}")["status"] == "completed"
    assert [p for alias, p, _ in api.lm.calls if alias == "assistant"] == ["Great value"]


def test_the_request_fields_of_the_selection_optimizer_are_checked(api: Client) -> None:
    base = {"pipeline": "sentiment", "dataset": FEWSHOT_TRAIN, "metric": "exact"}
    for extra, problem in (
        ({"optimizer": {"budget": 5}}, "cannot pay for one validation"),
        ({"optimizer": {"candidates_per_step": 0}}, "candidates_per_step"),
        ({"optimizer": {"type": "sfa"}, "validation_dataset": FEWSHOT_VALIDATION}, "eval_dataset"),
        ({"validation_dataset": []}, "validation_dataset"),
        ({"dataset": FEWSHOT_TRAIN[:1]}, "validation_dataset"),
    ):
        error = api.post("/v1/trainings", {**base, **extra}, status=400)["error"]
        assert problem in error["message"], error
    # a registered split names the validation set; sfa stays selectable
    assert api.post("/v1/trainings", {**base, "validation_dataset": "sentiment:validation",
                                      "optimizer": {"budget": 200}})["validation_dataset"] == {"name": "sentiment:validation"}
    assert api.post("/v1/trainings", {**base, "optimizer": {"type": "sfa"}})["optimizer"]["type"] == "sfa"
