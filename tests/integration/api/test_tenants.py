"""Two tenants on one server (PostgreSQL): everything one creates is invisible to the other, parameter versions
and their activation included. Keys: ``acme:sk-acme`` names the tenant acme; ``sk-bare`` is a tenant of its own."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from api.main import create_app
from app.jobs.runtime import JobsRuntime
from app.jobs.tenants import KeyRing, bare_key_tenant, parse_key
from app.pipeline.resources.types import LLMRequest
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend

A = {"Authorization": "Bearer sk-acme"}
B = {"Authorization": "Bearer sk-bare"}
GOOD_PROMPT = "Answer with exactly one word: positive or negative."
DATASET = [
    {"input": "Great phone, I love it", "target": "positive"},
    {"input": "Broke after a day, awful", "target": "negative"},
]
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def scripted(alias: str, request: LLMRequest) -> str:
    if alias == "assistant":
        label = "positive" if "Great" in str(request.prompt) else "negative"
        return label if "one word" in str(request.system_prompt or "") else f"I think it is {label}."
    if alias == "optimizer/updater":
        return GOOD_PROMPT
    if alias == "optimizer/aggregator":
        return "Reply with the label only."
    return "ok"


class Client:
    def __init__(self, client: TestClient, headers: dict[str, str]) -> None:
        self.client = client
        self.headers = headers

    def call(self, method: str, path: str, status: int, **kwargs: Any) -> Any:
        response = self.client.request(method, path, headers=self.headers, **kwargs)
        assert response.status_code == status, (method, path, response.status_code, response.text)
        return response.json() if response.headers.get("content-type", "").startswith("application/json") \
            else response.text

    def wait(self, path: str, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.call("GET", path, 200)
            if view["status"] in TERMINAL:
                return view
            assert time.monotonic() < deadline, view
            time.sleep(0.05)


@pytest.fixture
def clients(committed: Engine) -> Iterator[tuple[Client, Client]]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False),
                      api_keys=["acme:sk-acme", "sk-bare"], jobs_poll_interval=0.05)
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=ScriptedLM(scripted)))
    with TestClient(app) as client:
        yield Client(client, A), Client(client, B)


def test_keys_name_their_tenants() -> None:
    assert parse_key("acme:sk-1").tenant == "acme" and parse_key("acme:sk-1").secret == "sk-1"
    assert parse_key("sk-plain").tenant == bare_key_tenant("sk-plain")
    assert parse_key(":sk-odd").tenant == bare_key_tenant(":sk-odd")  # no tenant name: a bare key
    ring = KeyRing(["acme:k1", "acme:k2", "solo"])
    assert ring.tenant_of("k1") == ring.tenant_of("k2") == ring.tenant_of("acme:k1") == "acme"
    assert ring.tenant_of("solo") == bare_key_tenant("solo") and ring.tenant_of("k3") is None
    assert KeyRing([]).tenant_of("anything") == "anonymous"


def _upload(client: Client, name: str, lines: list[dict[str, Any]], purpose: str) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    view = client.call("POST", "/v1/files", 200, files={"file": (name, content, "application/jsonl")},
                       data={"purpose": purpose})
    return str(view["id"])


def _invisible(other: Client, paths: list[str], posts: list[str]) -> None:
    for path in paths:
        error = other.call("GET", path, 404)["error"]
        assert error["type"] == "invalid_request_error", (path, error)
    for path in posts:
        other.call("POST", path, 404, json={})


def test_every_resource_belongs_to_its_tenant(clients: tuple[Client, Client]) -> None:
    a, b = clients
    job = a.call("POST", "/v1/jobs", 201, json={"pipeline": "sentiment", "inputs": ["Great phone"]})
    data_file = _upload(a, "in.jsonl", [{"custom_id": "x", "input": "Great"}], "user_data")
    batch_file = _upload(a, "batch.jsonl", [{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                                             "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}],
                         "batch")
    batch = a.call("POST", "/v1/batches", 200, json={"input_file_id": batch_file, "endpoint": "/v1/chat/completions",
                                                     "completion_window": "24h"})
    evaluation = a.call("POST", "/v1/evaluations", 201, json={"pipeline": "sentiment", "dataset": DATASET,
                                                              "metric": "exact"})
    schedule = a.call("POST", "/v1/evaluations/schedules", 201,
                      json={"pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "cron": "0 3 * * *"})
    human = a.call("POST", "/v1/trainings", 201, json={"pipeline": "sentiment", "dataset": DATASET[:1],
                                                       "loss": {"type": "human"}, "optimizer": {"type": "sfa"}})
    deadline = time.monotonic() + 15
    while not (pending := a.call("GET", "/v1/feedback/pending", 200)["data"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    _invisible(b, [
        f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/results", f"/v1/jobs/{job['id']}/trace",
        f"/v1/jobs/{job['id']}/items", f"/v1/jobs/{job['id']}/items/export",
        f"/v1/evaluations/{evaluation['id']}/examples",
        f"/v1/files/{data_file}", f"/v1/files/{data_file}/content", f"/v1/batches/{batch['id']}",
        f"/v1/evaluations/{evaluation['id']}", f"/v1/evaluations/schedules/{schedule['id']}",
        f"/v1/evaluations/schedules/{schedule['id']}/runs", f"/v1/trainings/{human['id']}",
    ], [
        f"/v1/jobs/{job['id']}/cancel", f"/v1/batches/{batch['id']}/cancel", f"/v1/trainings/{human['id']}/cancel",
        f"/v1/evaluations/{evaluation['id']}/cancel", f"/v1/evaluations/schedules/{schedule['id']}/pause",
        f"/v1/feedback/{pending[0]['id']}",
    ])
    b.call("DELETE", f"/v1/files/{data_file}", 404)
    # b cannot use a's file as its input either
    assert b.call("POST", "/v1/jobs", 400, json={"pipeline": "sentiment", "input_file_id": data_file}
                  )["error"]["code"] == "file_not_found"
    for listing in ("/v1/jobs", "/v1/files", "/v1/batches", "/v1/evaluations", "/v1/evaluations/schedules",
                    "/v1/trainings", "/v1/feedback/pending"):
        assert b.call("GET", listing, 200)["data"] == [], listing
        assert a.call("GET", listing, 200)["data"], listing
    a.call("POST", f"/v1/trainings/{human['id']}/cancel", 200, json={})
    a.wait(f"/v1/trainings/{human['id']}")


def test_parameter_versions_and_activation_are_per_tenant(clients: tuple[Client, Client]) -> None:
    a, b = clients
    trained = a.call("POST", "/v1/trainings", 201, json={"pipeline": "sentiment", "dataset": DATASET,
                                                         "metric": "exact", "batch_size": 2})
    assert a.wait(f"/v1/trainings/{trained['id']}")["final_version"] == 2
    versions = "/v1/pipelines/sentiment/parameters/versions"
    assert a.call("GET", versions, 200)["active_version"] == 2
    # b sees none of a's versions and cannot diff, read or activate them
    assert b.call("GET", versions, 404)["error"]["code"] == "pipeline_not_found"
    b.call("GET", f"{versions}/1", 404)
    b.call("GET", f"{versions}/diff", 404, params={"from": 1, "to": 2})
    b.call("POST", f"{versions}/1/activate", 404)
    # b's jobs run the code's own prompt (the operator's default), a's jobs run a's trained one
    b_job = b.call("POST", "/v1/jobs", 201, json={"pipeline": "sentiment", "inputs": ["Great phone"]})
    a_job = a.call("POST", "/v1/jobs", 201, json={"pipeline": "sentiment", "inputs": ["Great phone"]})
    assert b.wait(f"/v1/jobs/{b_job['id']}")["status"] == "completed"
    assert a.wait(f"/v1/jobs/{a_job['id']}")["status"] == "completed"
    b_out = [json.loads(line) for line in b.call("GET", f"/v1/jobs/{b_job['id']}/results", 200).splitlines()]
    a_out = [json.loads(line) for line in a.call("GET", f"/v1/jobs/{a_job['id']}/results", 200).splitlines()]
    assert a_out[0]["output"] == "positive" and b_out[0]["output"] != "positive"
    # b trains its own history, numbered from 1; rolling b back leaves a's active version alone
    b_trained = b.call("POST", "/v1/trainings", 201, json={"pipeline": "sentiment", "dataset": DATASET,
                                                           "metric": "exact", "batch_size": 2})
    assert b.wait(f"/v1/trainings/{b_trained['id']}")["final_version"] == 2
    b.call("POST", f"{versions}/1/activate", 200)
    assert b.call("GET", versions, 200)["active_version"] == 1
    assert a.call("GET", versions, 200)["active_version"] == 2
