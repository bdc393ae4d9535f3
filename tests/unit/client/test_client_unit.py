"""The client without a server (httpx's MockTransport): URLs, headers, the error classes and what they carry,
streams closed early, the settings' defaults, and that importing it needs no server package."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.client import (
    APIConnectionError,
    APIResponseValidationError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    settings_defaults,
)
from app.client.types import BatchStatus, ItemStatus, JobStatus, RunStatus
from app.settings import Settings

JOB = {
    "id": "job_1", "object": "job", "pipeline": "p", "status": "running", "priority": 0, "metadata": {},
    "idempotency_key": None, "input_file_id": None,
    "counts": {"total": 2, "completed": 1, "failed": 0, "cancelled": 0, "pending": 1}, "error": None,
    "created_at": 1, "started_at": 2, "cancelling_at": None, "cancelled_at": None, "completed_at": None,
    "failed_at": None, "finished_at": None,
}


def _client(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> Client:
    return Client("http://server.test:8000/v1/", api_key="acme:sk-1", transport=httpx.MockTransport(handler),
                  **kwargs)


def _error(status: int, message: str, **fields: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                  "param": None, "code": None, **fields}})


def test_statuses_match_the_database() -> None:
    from app.db import BatchStatus as DbBatch
    from app.db import ItemStatus as DbItem
    from app.db import JobStatus as DbJob
    from app.db.optimization_models import RunStatus as DbRun

    for ours, theirs in ((JobStatus, DbJob), (ItemStatus, DbItem), (BatchStatus, DbBatch), (RunStatus, DbRun)):
        assert [s.value for s in ours] == [s.value for s in theirs]


def test_requests_go_to_the_root_with_the_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/jobs":
            return httpx.Response(200, json={"object": "list", "data": [JOB], "first_id": "job_1",
                                             "last_id": "job_1", "has_more": False})
        return httpx.Response(200, json=JOB)

    with _client(handler) as client:
        assert client.base_url == "http://server.test:8000"
        job = client.jobs.get("../job 1")
        assert client.jobs.list(status=["queued", "running"], limit=5).data == [job]
    assert job.status == JobStatus.RUNNING and job.counts.pending == 1 and job.usage is None
    assert seen[0].url.raw_path == b"/v1/jobs/..%2Fjob%201"  # an id stays one path segment
    assert seen[0].headers["authorization"] == "Bearer acme:sk-1"
    assert seen[0].headers["user-agent"].startswith("inf-engine-client/")
    assert seen[1].url.params["status"] == "queued,running" and seen[1].url.params["limit"] == "5"
    with _client(handler) as client, pytest.raises(ValueError, match="empty id"):
        client.jobs.get("")


@pytest.mark.parametrize(("status", "kind"), [
    (400, BadRequestError), (401, AuthenticationError), (404, NotFoundError), (409, ConflictError),
    (413, PayloadTooLargeError), (429, RateLimitError), (503, InternalServerError),
])
def test_each_status_has_its_class(status: int, kind: type[Exception]) -> None:
    with _client(lambda request: _error(status, "nope", param="job_id", code="x")) as client, \
            pytest.raises(kind) as caught:
        client.jobs.get("job_1")
    error: Any = caught.value
    assert error.status_code == status and error.message == "nope" and str(error) == f"HTTP {status}: nope"
    assert error.body == {"error": {"message": "nope", "type": "invalid_request_error", "param": "job_id",
                                    "code": "x"}}
    assert (error.type, error.param, error.code) == ("invalid_request_error", "job_id", "x")
    assert error.response.status_code == status


def test_rate_limit_retry_after_and_bodies_that_are_not_json() -> None:
    def limited(request: httpx.Request) -> httpx.Response:
        response = _error(429, "quota", code="job_quota")
        response.headers["Retry-After"] = "7"
        return response

    with _client(limited) as client, pytest.raises(RateLimitError) as caught:
        client.files.list()
    assert caught.value.retry_after == 7.0 and caught.value.code == "job_quota"

    with _client(lambda request: httpx.Response(502, text="Bad gateway from the proxy")) as client, \
            pytest.raises(InternalServerError) as failed:
        client.batches.get("batch_1")
    assert failed.value.message == "Bad gateway from the proxy" and failed.value.body is None

    with _client(lambda request: httpx.Response(200, json={"id": "job_1"})) as client, \
            pytest.raises(APIResponseValidationError, match="not a Job"):
        client.jobs.get("job_1")


def test_unreachable_server() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with _client(refuse) as client, pytest.raises(APIConnectionError, match="cannot reach") as caught:
        client.jobs.list()
    assert caught.value.status_code is None and caught.value.body is None


def test_a_stream_closed_early_stops_reading() -> None:
    lines = [{"custom_id": f"c{i}", "status": "completed", "output": i} for i in range(3)]
    lines.append({"custom_id": "c3", "status": "failed", "error": {"type": "ValueError", "message": "bad"}})
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with _client(lambda request: httpx.Response(200, content=body)) as client:
        with client.jobs.results("job_1") as stream:
            first = next(stream)
        assert first.custom_id == "c0" and first.ok and list(stream) == []
        every = list(client.jobs.results("job_1", cursor=0, follow=True))
    assert [r.custom_id for r in every] == ["c0", "c1", "c2", "c3"]
    assert not every[3].ok and every[3].error == {"type": "ValueError", "message": "bad"}


async def test_async_client_uploads_multipart() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"id": "file-1", "object": "file", "bytes": 3, "created_at": 1,
                                         "expires_at": None, "filename": "in.jsonl", "purpose": "user_data",
                                         "status": "processed", "status_details": None})

    async with AsyncClient("http://server.test", transport=httpx.MockTransport(handler)) as client:
        uploaded = await client.files.upload(b"{}\n", purpose="user_data", filename="in.jsonl")
    assert uploaded.id == "file-1"
    request = seen[0]
    assert request.method == "POST" and request.url.path == "/v1/files" and "authorization" not in request.headers
    content = request.read()
    assert b'name="purpose"\r\n\r\nuser_data' in content and b'filename="in.jsonl"' in content


def test_defaults_come_from_the_settings_given() -> None:
    assert settings_defaults(Settings(serve_port=9001, api_keys=["acme:sk-a", "sk-b"])) == {
        "base_url": "http://127.0.0.1:9001", "api_key": "acme:sk-a"}
    given = Settings(api_url="http://jobs.example:8080/v1", api_key="sk-mine", api_keys=["acme:sk-a"])
    with Client.from_settings(given, api_key="sk-other") as client:
        assert client.base_url == "http://jobs.example:8080"
        assert client._async._core.api_key == "sk-other"


def test_importing_the_client_needs_no_server_package() -> None:
    code = ("import sys, app.client; bad = {'sqlalchemy', 'fastapi', 'starlette', 'celery', 'uvicorn', 'torch'}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in bad or m.startswith(('app.db', 'app.jobs'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
