"""/v1/jobs over HTTP (FastAPI TestClient, real lifespan) on PostgreSQL, with a scripted LLM behind the jobs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from api.main import create_app
from app.db import Item, Job
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend

KEY = "sk-jobs-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
REVIEWS = [{"custom_id": f"r{i}", "input": {"review": f"review {i}"}} for i in range(3)]


class Harness:
    def __init__(self, client: TestClient, lm: ScriptedLM, engine: Engine) -> None:
        self.client = client
        self.lm = lm
        self.engine = engine

    def submit(self, inputs: Any = REVIEWS, **body: Any) -> dict[str, Any]:
        response = self.client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": inputs, **body},
                                    headers=AUTH)
        assert response.status_code == 201, response.text
        return response.json()

    def wait(self, job_id: str, statuses: set[str], timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()
            if view["status"] in statuses:
                return view
            assert time.monotonic() < deadline, view
            time.sleep(0.05)

    def rows(self) -> tuple[int, int]:
        with self.engine.connect() as connection:
            jobs = connection.scalar(select(func.count()).select_from(Job))
            items = connection.scalar(select(func.count()).select_from(Item))
        return int(jobs or 0), int(items or 0)


def _harness(engine: Engine, lm: ScriptedLM, **settings: Any) -> Iterator[Harness]:
    options = {"database_url": engine.url.render_as_string(hide_password=False), "api_keys": [KEY],
               "jobs_poll_interval": 0.05, "jobs_max_items": 20, "jobs_max_bytes": 4000, **settings}
    config = Settings(**options)
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=lm))
    with TestClient(app) as client:
        yield Harness(client, lm, engine)


@pytest.fixture
def api(committed: Engine) -> Iterator[Harness]:
    yield from _harness(committed, ScriptedLM(latency=0.01))


def _lines(response: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def test_job_lifecycle_over_http(api: Harness) -> None:
    job = api.submit(metadata={"purpose": "test"}, priority=2)
    assert job["object"] == "job" and job["status"] == "queued" and job["id"].startswith("job_")
    assert job["counts"]["total"] == 3 and job["metadata"] == {"purpose": "test"} and job["priority"] == 2
    done = api.wait(job["id"], {"completed", "failed"})
    assert done["status"] == "completed" and done["counts"]["completed"] == 3
    assert done["usage"]["llm_calls"] == 9 and len(api.lm.calls) == 9

    results = api.client.get(f"/v1/jobs/{job['id']}/results", headers=AUTH)
    assert results.status_code == 200 and results.headers["content-type"].startswith("application/x-ndjson")
    lines = _lines(results)
    assert sorted(line["custom_id"] for line in lines) == ["r0", "r1", "r2"]
    assert all(line["status"] == "completed" and set(line["output"]) == {"liked", "disliked", "verdict"}
               for line in lines)
    rest = _lines(api.client.get(f"/v1/jobs/{job['id']}/results", params={"cursor": 1}, headers=AUTH))
    assert rest == lines[1:]

    listing = api.client.get("/v1/jobs", headers=AUTH).json()
    assert listing["object"] == "list" and [j["id"] for j in listing["data"]] == [job["id"]]
    assert api.client.get("/v1/jobs", params={"status": "running"}, headers=AUTH).json()["data"] == []

    trace = api.client.get(f"/v1/jobs/{job['id']}/trace", headers=AUTH)
    assert trace.status_code == 200
    events = trace.json()["traceEvents"]
    assert any("LLMInference" in str(event.get("name")) for event in events)

    # the OpenAI routes live in the same app
    assert api.client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "fake-model"


def test_api_key_and_owner(api: Harness, committed: Engine) -> None:
    assert api.client.get("/v1/jobs").status_code == 401
    response = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": REVIEWS})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    job = api.submit()
    missing = api.client.get("/v1/jobs/job_doesnotexist", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("no job")
    for path in ("", "/results", "/trace"):
        assert api.client.get(f"/v1/jobs/job_nope{path}", headers=AUTH).status_code == 404
    assert api.client.post("/v1/jobs/job_nope/cancel", headers=AUTH).status_code == 404
    api.wait(job["id"], {"completed"})


def test_two_keys_see_only_their_jobs(committed: Engine) -> None:
    for harness in _harness(committed, ScriptedLM(), api_keys=[KEY, "sk-other"]):
        job = harness.submit()
        other = {"Authorization": "Bearer sk-other"}
        assert harness.client.get(f"/v1/jobs/{job['id']}", headers=other).status_code == 404
        assert harness.client.get("/v1/jobs", headers=other).json()["data"] == []
        harness.wait(job["id"], {"completed"})


def test_idempotency_key_returns_the_same_job(api: Harness) -> None:
    first = api.submit(idempotency_key="nightly-2024-01-01")
    again = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": REVIEWS,
                                              "idempotency_key": "nightly-2024-01-01"}, headers=AUTH)
    assert again.status_code == 201 and again.json()["id"] == first["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    by_header = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": REVIEWS},
                                headers={**AUTH, "Idempotency-Key": "from-header"})
    replay = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": REVIEWS},
                             headers={**AUTH, "Idempotency-Key": "from-header"})
    assert by_header.json()["id"] == replay.json()["id"] != first["id"]
    # the same key with another body is a conflict (Stripe's rule), never the first job handed back silently
    for changed in ({"inputs": REVIEWS[:1]}, {"pipeline": "sentiment"}, {"priority": 5}, {"metadata": {"a": 1}}):
        body = {"pipeline": "review-compare", "inputs": REVIEWS, "idempotency_key": "nightly-2024-01-01", **changed}
        conflict = api.client.post("/v1/jobs", json=body, headers=AUTH)
        assert conflict.status_code == 409, (changed, conflict.text)
        error = conflict.json()["error"]
        assert error["code"] == "idempotency_key_reused" and error["param"] == "idempotency_key"
        assert first["id"] in error["message"]
    assert api.rows()[0] == 2
    api.wait(first["id"], {"completed"})
    api.wait(by_header.json()["id"], {"completed"})


BIG = [{"custom_id": f"x{i}", "input": "y" * 300} for i in range(12)]  # more than jobs_max_bytes=4000


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"pipeline": "no.such:Pipeline", "inputs": REVIEWS}, 400, "unknown pipeline"),
        ({"pipeline": "review-compare", "inputs": '{"custom_id": "a", "input": "x"}\n{oops\n'}, 400,
         "line 2 is not valid JSON"),
        ({"pipeline": "review-compare", "inputs": [{"custom_id": "a", "input": "x"}, {"custom_id": "a", "input": "y"}]},
         400, "duplicate custom_id"),
        ({"pipeline": "review-compare", "inputs": [{"custom_id": str(i), "input": "x"} for i in range(21)]}, 413,
         "at most 20"),
        ({"pipeline": "review-compare", "inputs": BIG}, 413, "at most 4000"),
        ({"pipeline": "review-compare"}, 400, "exactly one"),
        ({"pipeline": "review-compare", "input_file_id": "file-nope"}, 400, "no uploaded file"),
        ({"pipeline": "review-compare", "inputs": REVIEWS, "colour": "red"}, 400, "colour"),
        ({"inputs": REVIEWS}, 400, "pipeline"),
        ({"pipeline": "review-compare", "inputs": [{"custom_id": "a", "input": {"wrong": 1}}]}, 400,
         "does not fit"),
    ],
)
def test_bad_requests_write_nothing(api: Harness, body: dict[str, Any], status: int, message: str) -> None:
    before = api.rows()
    response = api.client.post("/v1/jobs", json=body, headers=AUTH)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert api.rows() == before
    assert api.client.get("/v1/jobs", headers=AUTH).json()["data"] == []


def test_malformed_body_is_a_400(api: Harness) -> None:
    response = api.client.post("/v1/jobs", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert api.client.post("/v1/jobs", content=b"", headers=AUTH).status_code == 400
    assert api.rows() == (0, 0)


def test_results_stream_while_the_job_runs(committed: Engine) -> None:
    for harness in _harness(committed, ScriptedLM(latency=0.1), default_max_concurrent=2):
        job = harness.submit(inputs=[{"custom_id": f"s{i}", "input": f"review {i}"} for i in range(6)])
        seen: list[tuple[str, str]] = []
        with harness.client.stream("GET", f"/v1/jobs/{job['id']}/results", params={"follow": "true"},
                                   headers=AUTH) as stream:
            for raw in stream.iter_lines():
                if not raw.strip():
                    continue
                line = json.loads(raw)
                status = harness.client.get(f"/v1/jobs/{job['id']}", headers=AUTH).json()["status"]
                seen.append((line["custom_id"], status))
        assert sorted(cid for cid, _ in seen) == [f"s{i}" for i in range(6)]
        assert seen[0][1] == "running"  # the first result arrived while the job was still running
        assert harness.client.get(f"/v1/jobs/{job['id']}", headers=AUTH).json()["status"] == "completed"


class HangingLM(ScriptedLM):
    """Answers prompts about review 0; every other request hangs until it is cancelled."""

    async def complete(self, alias: str, request: Any) -> Any:
        if "review 0" not in str(request.prompt):
            import asyncio

            await asyncio.Event().wait()
        return await super().complete(alias, request)


def test_cancel_over_http(committed: Engine) -> None:
    for harness in _harness(committed, HangingLM()):
        job = harness.submit()
        with harness.client.stream("GET", f"/v1/jobs/{job['id']}/results", params={"follow": "true"},
                                   headers=AUTH) as stream:
            lines = (line for line in stream.iter_lines() if line.strip())
            first = json.loads(next(lines))
            assert first["custom_id"] == "r0"
            cancel = harness.client.post(f"/v1/jobs/{job['id']}/cancel", headers=AUTH)
            assert cancel.status_code == 200 and cancel.json()["status"] == "cancelling"
            rest = [json.loads(line) for line in lines]
        # the follow stream ended by itself when the job ended
        assert sorted(line["custom_id"] for line in rest) == ["r1", "r2"]
        assert all(line["status"] == "cancelled" and line["error"]["type"] == "Cancelled" for line in rest)
        done = harness.wait(job["id"], {"cancelled"})
        assert done["counts"] == {"total": 3, "completed": 1, "failed": 0, "cancelled": 2, "pending": 0}
        again = harness.client.post(f"/v1/jobs/{job['id']}/cancel", headers=AUTH)
        assert again.status_code == 409 and "already cancelled" in again.json()["error"]["message"]


def test_bad_query_parameters(api: Harness) -> None:
    assert api.client.get("/v1/jobs", params={"status": "sleeping"}, headers=AUTH).status_code == 400
    assert api.client.get("/v1/jobs", params={"limit": 0}, headers=AUTH).status_code == 400
    job = api.submit()
    bad_cursor = api.client.get(f"/v1/jobs/{job['id']}/results", params={"cursor": -1}, headers=AUTH)
    assert bad_cursor.status_code == 400
    api.wait(job["id"], {"completed"})


def test_submit_by_uploaded_file_id(api: Harness) -> None:
    import hashlib

    from sqlalchemy.orm import Session

    from app.db import repository
    from app.jobs.ids import new_file_id

    file_id = new_file_id()
    with Session(api.engine) as session:  # what POST /v1/files stores, for this key's owner
        repository.create_file(session, file_id=file_id, purpose="batch", filename="in.jsonl",
                               content=b'{"custom_id": "f1", "input": "a"}\n{"custom_id": "f2", "input": "b"}\n',
                               owner="key-" + hashlib.sha256(KEY.encode()).hexdigest()[:24])
        session.commit()
    job = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "input_file_id": file_id}, headers=AUTH)
    assert job.status_code == 201, job.text
    assert job.json()["input_file_id"] == file_id and job.json()["counts"]["total"] == 2
    alias = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "file_id": file_id}, headers=AUTH)
    assert alias.status_code == 201
    api.wait(job.json()["id"], {"completed"})
    api.wait(alias.json()["id"], {"completed"})
