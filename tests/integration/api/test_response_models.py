"""The response models of the OpenAPI document match what the routes really answer: every job, item, file, batch,
training, parameter-version, pipeline, evaluation, comparison and schedule answer of a run through the whole API
(on SQLite, a scripted classifier behind the jobs) is checked against its operation's schema, strictly (no key
the model does not name, null only where the model allows it)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from app.db import create_db_engine, make_session_factory, session_scope, utcnow
from app.jobs.learning.evaluations import fire_due_schedules
from app.jobs.runtime import JobsRuntime
from app.pipeline.resources.types import LLMRequest, LLMResponse
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.openapi import ResponseChecker
from tests.support.serving_fakes import FakeBackend
from tests.support.training import DATASET, scripted

TERMINAL = {"completed", "failed", "cancelled", "expired"}


def reply(alias: str, request: LLMRequest) -> str:
    if "explode" in str(request.prompt):
        raise ValueError("the scripted model refuses this review")
    return scripted(alias, request)


class SlowLM(ScriptedLM):
    """Answers a review that says 'slow' after a second: a job of them can be cancelled while it runs."""

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        if "slow" in str(request.prompt):
            await asyncio.sleep(1.0)
        return await super().complete(alias, request)


SCENARIOS = 4  # the tests above that call the API


class Api:
    """A client whose every answer is checked against the document (``path`` is the template)."""

    def __init__(self, client: TestClient, checker: ResponseChecker) -> None:
        self.client = client
        self.checker = checker
        self.scenarios: set[str] = set()  # the scenario tests that ran to the end

    def call(self, method: str, path: str, status: int = 200, ids: dict[str, Any] | None = None,
             query: dict[str, Any] | None = None, **request: Any) -> Any:
        url = path.format(**(ids or {}))
        response = self.client.request(method, url, params=query, **request)
        assert response.status_code == status, f"{method} {url}: {response.status_code} {response.text[:500]}"
        body = response.json()
        self.checker.check(method, path, status, body)
        return body

    def wait(self, path: str, **ids: Any) -> Any:
        for _ in range(400):
            view = self.call("GET", path, ids=ids)
            if view["status"] in TERMINAL:
                return view
            time.sleep(0.05)
        raise AssertionError(f"{path} {ids} did not finish")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    config = Settings(data_dir=tmp_path_factory.mktemp("models") / "state", jobs_poll_interval=0.05)
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=SlowLM(reply)))
    with TestClient(app) as client:
        yield Api(client, ResponseChecker(app.openapi()))


def test_job_answers(api: Api) -> None:
    made = api.call("POST", "/v1/jobs", 201, json={"pipeline": "sentiment", "metadata": {"k": "v"},
                                                    "inputs": ["Great phone", "it will explode",
                                                               {"custom_id": "kw", "input": {"review": "Lovely"}}]})
    done = api.wait("/v1/jobs/{job_id}", job_id=made["id"])
    assert done["status"] == "completed" and done["usage"]["llm_calls"] == 2
    api.call("GET", "/v1/jobs")
    api.call("GET", "/v1/jobs", query={"pipeline": "sentiment", "status": "completed,failed", "limit": 1})
    page = api.call("GET", "/v1/jobs/{job_id}/items", ids={"job_id": made["id"]})
    assert {row["status"] for row in page["data"]} == {"completed", "failed"}
    api.call("GET", "/v1/jobs/{job_id}/items", ids={"job_id": made["id"]},
             query={"order": "failures_first", "q": "e", "limit": 1})
    queued = api.call("POST", "/v1/jobs", 201, json={"pipeline": "sentiment", "inputs": ["slow a", "slow b"]})
    api.call("POST", "/v1/jobs/{job_id}/cancel", ids={"job_id": queued["id"]})
    api.call("GET", "/v1/jobs/{job_id}/items", ids={"job_id": queued["id"]})  # pending or cancelled items
    api.wait("/v1/jobs/{job_id}", job_id=queued["id"])
    api.scenarios.add("test_job_answers")


def test_file_and_batch_answers(api: Api) -> None:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"hi {i}"}]}} for i in range(2)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = api.call("POST", "/v1/files", files={"file": ("batch.jsonl", content, "application/jsonl")},
                    data={"purpose": "batch"})
    api.call("GET", "/v1/files")
    api.call("GET", "/v1/files/{file_id}", ids={"file_id": file["id"]})
    batch = api.call("POST", "/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h", "metadata": {"team": "a"}})
    done = api.wait("/v1/batches/{batch_id}", batch_id=batch["id"])
    assert done["status"] == "completed" and (done["output_file_id"] or done["error_file_id"])
    api.call("GET", "/v1/batches")
    slow = [{**line, "body": {"model": "fake-model", "messages": [{"role": "user", "content": "slow"}]}}
            for line in lines]
    slow_file = api.call("POST", "/v1/files", data={"purpose": "batch"}, files={
        "file": ("slow.jsonl", "".join(json.dumps(line) + "\n" for line in slow).encode(), "application/jsonl")})
    other = api.call("POST", "/v1/batches", json={"input_file_id": slow_file["id"],
                                                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    api.call("POST", "/v1/batches/{batch_id}/cancel", ids={"batch_id": other["id"]})
    api.wait("/v1/batches/{batch_id}", batch_id=other["id"])
    spare = api.call("POST", "/v1/files", files={"file": ("in.jsonl", b'{"input": "x"}\n', "application/jsonl")},
                     data={"purpose": "user_data"})
    api.call("DELETE", "/v1/files/{file_id}", ids={"file_id": spare["id"]})
    api.scenarios.add("test_file_and_batch_answers")


def test_training_version_and_pipeline_answers(api: Api) -> None:
    made = api.call("POST", "/v1/trainings", 201, json={"pipeline": "sentiment", "dataset": DATASET,
                                                        "metric": "exact", "batch_size": 4})
    done = api.wait("/v1/trainings/{training_id}", training_id=made["id"])
    assert done["status"] == "completed" and done["steps"]
    api.call("GET", "/v1/trainings")
    queued = api.call("POST", "/v1/trainings", 201, json={"pipeline": "sentiment", "dataset": DATASET[:1],
                                                          "loss": {"type": "human"}, "optimizer": {"type": "sfa"}})
    api.call("POST", "/v1/trainings/{training_id}/cancel", ids={"training_id": queued["id"]})
    api.wait("/v1/trainings/{training_id}", training_id=queued["id"])
    name = {"name": "sentiment"}
    api.call("GET", "/v1/pipelines/{name}/parameters/versions", ids=name)
    api.call("GET", "/v1/pipelines/{name}/parameters/versions/{version}", ids={**name, "version": 2})
    api.call("GET", "/v1/pipelines/{name}/parameters/versions/diff", ids=name, query={"from": 1, "to": 2})
    api.call("POST", "/v1/pipelines/{name}/parameters/versions/{version}/activate", ids={**name, "version": 2})
    listing = api.call("GET", "/v1/pipelines")
    assert any(p["name"] == "sentiment" and p["versions"] == 2 for p in listing["data"])
    api.scenarios.add("test_training_version_and_pipeline_answers")


def test_evaluation_and_schedule_answers(api: Api, tmp_path: Path) -> None:
    dataset = [*DATASET, {"input": "it will explode", "target": "negative"}]
    first = api.call("POST", "/v1/evaluations", 201, json={"pipeline": "sentiment", "dataset": dataset,
                                                           "metric": "exact", "metadata": {"run": 1}})
    first = api.wait("/v1/evaluations/{evaluation_id}", evaluation_id=first["id"])
    second = api.call("POST", "/v1/evaluations", 201, json={"pipeline": "sentiment", "dataset": dataset[:3],
                                                            "metric": "exact", "version": 1})
    api.wait("/v1/evaluations/{evaluation_id}", evaluation_id=second["id"])
    api.call("GET", "/v1/evaluations")
    examples = "/v1/evaluations/{evaluation_id}/examples"
    compared = api.call("GET", examples, ids={"evaluation_id": second["id"]}, query={"order": "regressions"})
    assert compared["baseline_id"] is None
    paired = api.call("GET", examples, ids={"evaluation_id": second["id"]}, query={"baseline": first["id"]})
    assert paired["summary"]["paired"] == 3
    api.call("GET", examples, ids={"evaluation_id": first["id"]}, query={"below": 0.5})
    queued = api.call("POST", "/v1/evaluations", 201, json={
        "pipeline": "sentiment", "dataset": [{"input": "slow review", "target": "negative"}], "metric": "exact"})
    api.call("POST", "/v1/evaluations/{evaluation_id}/cancel", ids={"evaluation_id": queued["id"]})

    schedule = api.call("POST", "/v1/evaluations/schedules", 201, json={
        "pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "cron": "@daily", "margin": 0.1})
    ids = {"schedule_id": schedule["id"]}
    api.call("GET", "/v1/evaluations/schedules")
    api.call("GET", "/v1/evaluations/schedules/{schedule_id}", ids=ids)
    _fire(api, days=1)
    api.call("POST", "/v1/evaluations/schedules/{schedule_id}/pause", ids=ids)
    api.call("POST", "/v1/evaluations/schedules/{schedule_id}/resume", ids=ids)
    runs = api.call("GET", "/v1/evaluations/schedules/{schedule_id}/runs", ids=ids)
    assert len(runs["data"]) == 1 and runs["data"][0]["regressed"] is False
    api.scenarios.add("test_evaluation_and_schedule_answers")


def _fire(api: Api, days: int) -> None:
    """Fire the due schedules as the beat would, then let the server run the evaluation."""
    settings = api.client.app.state.settings  # type: ignore[attr-defined]
    from app.db.session import database_url

    engine = create_db_engine(database_url(settings))
    try:
        with session_scope(make_session_factory(engine)) as session:
            created = fire_due_schedules(session, now=utcnow() + timedelta(days=days))
    finally:
        engine.dispose()
    api.call("GET", "/v1/evaluations")  # wakes the server's executor
    for evaluation_id in created:
        api.wait("/v1/evaluations/{evaluation_id}", evaluation_id=evaluation_id)


def test_every_modelled_route_was_checked(api: Api) -> None:
    """The scenarios above touched every route that names a response model (it runs last in this module)."""
    if len(api.scenarios) < SCENARIOS:
        pytest.skip("only with every scenario test of this module run before it (it checks what they touched)")
    document = api.checker.document
    modelled = {(method.upper(), path) for path, operations in document["paths"].items()
                for method, operation in operations.items()
                if any(api.checker.schema_name(method, path, int(status)) for status in operation["responses"]
                       if status.isdigit() and int(status) < 300)}
    assert modelled - api.checker.checked == set()
