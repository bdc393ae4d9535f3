"""Training jobs, parameter versions, human feedback and evaluations over HTTP on PostgreSQL, with a scripted LM
behind the pipeline, the optimizer and the judges."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from api.main import create_app
from app.db import ParameterVersion
from app.db.optimization_models import FeedbackRequestRow, Training
from app.jobs.runtime import JobsRuntime
from app.pipeline import LLMInference, Module
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend
from tests.support.training import DATASET, GOOD_PROMPT, scripted

KEY = "sk-training-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
class Frozen(Module):
    """A pipeline with nothing to learn (its prompt is a plain string)."""

    def __init__(self) -> None:
        super().__init__()
        self.classify = LLMInference("assistant", system_prompt="Classify.")

    def forward(self, review: str) -> object:
        return self.classify(review)




class Harness:
    def __init__(self, client: TestClient, lm: ScriptedLM, engine: Engine) -> None:
        self.client = client
        self.lm = lm
        self.engine = engine

    def post(self, path: str, body: dict[str, Any], status: int = 201) -> dict[str, Any]:
        response = self.client.post(path, json=body, headers=AUTH)
        assert response.status_code == status, response.text
        return response.json()

    def get(self, path: str, status: int = 200, **params: Any) -> dict[str, Any]:
        response = self.client.get(path, params=params, headers=AUTH)
        assert response.status_code == status, response.text
        return response.json()

    def wait(self, path: str, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.get(path)
            if view["status"] in {"completed", "failed", "cancelled"}:
                return view
            assert time.monotonic() < deadline, view
            time.sleep(0.05)

    def count(self, model: Any) -> int:
        with self.engine.connect() as connection:
            return int(connection.scalar(select(func.count()).select_from(model)) or 0)


@pytest.fixture
def api(committed: Engine) -> Iterator[Harness]:
    lm = ScriptedLM(scripted)
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05, jobs_max_items=50, pipeline_modules=[__name__])
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=lm))
    with TestClient(app) as client:
        yield Harness(client, lm, committed)


def test_training_stores_versions_then_diff_activate_and_jobs_follow(api: Harness) -> None:
    created = api.post("/v1/trainings", {"pipeline": "sentiment", "dataset": DATASET,
                                         "loss": {"type": "verifier", "check": "exact"},
                                         "optimizer": {"type": "sfa", "conservatism": 0.5},
                                         "epochs": 1, "batch_size": 2, "seed": 0})
    assert created["object"] == "training" and created["status"] == "queued" and created["id"].startswith("train_")
    assert created["progress"] == {"completed_steps": 0, "total_steps": 2}
    done = api.wait(f"/v1/trainings/{created['id']}")
    assert done["status"] == "completed", done
    # step 1 fails both examples and rewrites the prompt; step 2 is perfect, so it is not stepped on
    assert [s["score"] for s in done["steps"]] == [0.0, 1.0]
    assert done["steps"][0]["version"] == 2 and done["steps"][1]["version"] is None
    assert done["base_version"] == 1 and done["final_version"] == 2 and done["result"]["activated"] is True

    versions = api.get("/v1/pipelines/sentiment/parameters/versions")
    assert [v["version"] for v in versions["data"]] == [1, 2] and versions["active_version"] == 2
    initial, trained = versions["data"]
    assert initial["source"] == "initial" and initial["state"] == {"classify.system_prompt": "You read product reviews."}
    assert trained["source"] == "training" and trained["training_id"] == created["id"] and trained["step"] == 1
    assert trained["state"] == {"classify.system_prompt": GOOD_PROMPT} and trained["active"]
    (update,) = trained["updates"]
    assert update["name"] == "classify.system_prompt" and update["old_value"] == "You read product reviews."
    assert update["new_value"] == GOOD_PROMPT and update["scores"] == [0.0, 0.0]
    assert update["feedback"] == "Reply with the label only."  # the aggregator's summary of the two items
    assert all("should be exactly" in item for item in update["feedback_items"])

    diff = api.get("/v1/pipelines/sentiment/parameters/versions/diff", **{"from": 1, "to": 2})
    (change,) = diff["changes"]
    assert change["name"] == "classify.system_prompt" and change["to"] == GOOD_PROMPT
    assert f"+{GOOD_PROMPT}" in change["diff"]

    # roll back to version 1: a later job runs with the original prompt
    activated = api.post("/v1/pipelines/sentiment/parameters/versions/1/activate", {}, status=200)
    assert activated["version"] == 1 and activated["active"] is True
    api.lm.calls.clear()
    job = api.post("/v1/jobs", {"pipeline": "sentiment", "inputs": ["Great value"]})
    assert api.wait(f"/v1/jobs/{job['id']}")["status"] == "completed"
    assert [system for alias, _, system in api.lm.calls if alias == "assistant"] == ["You read product reviews."]

    # evaluations score whichever version is active (or the one asked for)
    before = api.post("/v1/evaluations", {"pipeline": "sentiment", "dataset": DATASET, "metric": "exact"})
    assert before["status"] == "queued" and before["progress"]["total_examples"] == 4
    before = api.wait(f"/v1/evaluations/{before['id']}")
    assert before["status"] == "completed" and before["score"] == 0.0 and before["parameter_version"] == 1
    assert before["scores"] == [0.0] * 4 and len(before["details"]["feedback"]) == 4
    after = api.post("/v1/evaluations", {"pipeline": "sentiment", "dataset": DATASET, "metric": "exact",
                                         "version": 2})
    after = api.wait(f"/v1/evaluations/{after['id']}")
    assert after["score"] == 1.0 and after["parameter_version"] == 2
    listing = api.get("/v1/evaluations")
    assert [e["id"] for e in listing["data"]] == [after["id"], before["id"]]


def test_bad_requests_write_nothing(api: Harness) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"pipeline": "nope:Nothing", "dataset": DATASET, "metric": "exact"}, "pipeline"),
        ({"pipeline": "sentiment", "dataset": [], "metric": "exact"}, "dataset"),
        ({"pipeline": "sentiment", "dataset": [{"text": "x"}], "metric": "exact"}, "dataset"),
        ({"pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "loss": {"type": "verifier"}}, "loss"),
        ({"pipeline": "sentiment", "dataset": DATASET, "loss": {"type": "magic"}}, "loss"),
        ({"pipeline": "sentiment", "dataset": DATASET, "loss": {"type": "rubric", "criteria": "x"}}, "loss"),
        ({"pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "optimizer": {"conservatism": 2}},
         "optimizer"),
        ({"pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "epochs": 0}, "epochs"),
        ({"pipeline": f"{__name__}:Frozen", "dataset": DATASET, "metric": "exact"}, "pipeline"),  # nothing to learn
        ({"pipeline": "sentiment", "dataset": "file-missing", "metric": "exact"}, "dataset"),
        ({"pipeline": "sentiment", "dataset": DATASET, "loss": {"type": "judge"}}, "loss"),  # gepa needs scores
    ]
    for body, param in cases:
        error = api.post("/v1/trainings", body, status=400)["error"]
        assert error["param"] == param, (body, error)
    schedule = {"pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "cron": "61 * * * *"}
    assert api.post("/v1/evaluations/schedules", schedule, status=400)["error"]["param"] == "cron"
    human = {"pipeline": "sentiment", "dataset": DATASET, "loss": {"type": "human"}}
    assert "only available to trainings" in api.post("/v1/evaluations", human, status=400)["error"]["message"]
    assert api.count(Training) == 0
    assert api.get("/v1/trainings/train_missing", status=404)["error"]["code"] == "training_not_found"
    assert api.get("/v1/pipelines/nobody:Here/parameters/versions", status=404)["error"]["code"] == "pipeline_not_found"
    assert api.client.get("/v1/trainings").status_code == 401


def test_human_feedback_over_rest_drives_a_training(api: Harness) -> None:
    loss = {"type": "human", "kind": "rubric", "criteria": "Is the answer a single label?",
            "rubric": {"1": "a sentence", "5": "one word"}}
    created = api.post("/v1/trainings", {"pipeline": "sentiment", "dataset": DATASET[:2], "loss": loss,
                                         "optimizer": "sfa", "epochs": 1, "batch_size": 2, "seed": 1})
    answered: list[str] = []
    problems: list[str] = []

    def person() -> None:  # a reviewer polling the REST API, as a UI would
        deadline = time.monotonic() + 15
        while len(answered) < 2 and time.monotonic() < deadline:
            for request in api.get("/v1/feedback/pending", training_id=created["id"])["data"]:
                assert request["kind"] == "rubric" and request["status"] == "pending"
                bad = api.client.post(f"/v1/feedback/{request['id']}", json={"score": 3}, headers=AUTH)
                if bad.status_code != 400:
                    problems.append(f"a score off the rubric got {bad.status_code}")
                good = api.client.post(f"/v1/feedback/{request['id']}",
                                       json={"score": 1, "content": "Say only positive or negative."},
                                       headers=AUTH)
                if good.status_code == 200:
                    answered.append(request["id"])
                    again = api.client.post(f"/v1/feedback/{request['id']}", json={"score": 5, "content": "x"},
                                            headers=AUTH)
                    if again.status_code != 409:
                        problems.append(f"a second answer got {again.status_code}")
            time.sleep(0.05)

    reviewer = threading.Thread(target=person)
    reviewer.start()
    done = api.wait(f"/v1/trainings/{created['id']}", timeout=20)
    reviewer.join()
    assert not problems and len(answered) == 2
    assert done["status"] == "completed" and done["steps"][0]["score"] == 0.0
    (update,) = done["steps"][0]["updates"]
    assert update["new_value"] == GOOD_PROMPT and len(update["feedback_items"]) == 2
    assert all(item.endswith("Feedback: Say only positive or negative.") for item in update["feedback_items"])
    assert api.count(FeedbackRequestRow) == 2
    assert api.get("/v1/feedback/pending")["data"] == []


def test_cancel_a_training_waiting_for_people(api: Harness) -> None:
    loss = {"type": "human", "kind": "freeform"}
    created = api.post("/v1/trainings", {"pipeline": "sentiment", "dataset": DATASET[:1], "loss": loss,
                                         "optimizer": "sfa"})
    deadline = time.monotonic() + 10
    while not api.get("/v1/feedback/pending")["data"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = api.post(f"/v1/trainings/{created['id']}/cancel", {}, status=200)
    assert cancelling["status"] in {"cancelling", "cancelled"}
    assert api.wait(f"/v1/trainings/{created['id']}")["status"] == "cancelled"
    assert api.get("/v1/feedback/pending")["data"] == []  # the open question was withdrawn
    assert api.post(f"/v1/trainings/{created['id']}/cancel", {}, status=409)["error"]["code"] == "training_finished"
    with api.engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(ParameterVersion)) == 1  # only the initial one


def test_datasets_from_uploaded_files(api: Harness) -> None:
    content = "".join(json.dumps(example) + "\n" for example in DATASET).encode()
    upload = api.client.post("/v1/files", files={"file": ("train.jsonl", content, "application/jsonl")},
                             data={"purpose": "user_data"}, headers=AUTH)
    assert upload.status_code in (200, 201), upload.text
    file_id = upload.json()["id"]
    created = api.post("/v1/trainings", {"pipeline": "sentiment", "dataset": file_id, "metric": "exact",
                                         "optimizer": "sfa", "batch_size": 4})
    assert created["progress"]["total_steps"] == 1
    done = api.wait(f"/v1/trainings/{created['id']}")
    assert done["status"] == "completed" and done["steps"][0]["score"] == 0.0
    evaluation = api.post("/v1/evaluations", {"pipeline": "sentiment", "dataset_file_id": file_id,
                                              "loss": {"type": "verifier", "check": "exact"}})
    assert api.wait(f"/v1/evaluations/{evaluation['id']}")["score"] == 1.0
