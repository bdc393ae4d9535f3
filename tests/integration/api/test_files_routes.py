"""/v1/files over HTTP (FastAPI TestClient, real lifespan) on PostgreSQL: upload checks (400/413, nothing
written), read, content, list, delete, owners."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from api.main import create_app
from app.db import File
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend

KEY = "sk-files-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": "Bearer sk-other"}


def _request(custom_id: str, **overrides: Any) -> dict[str, Any]:
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {custom_id}"}]}}
    return {**line, **overrides}


def _jsonl(*lines: Any) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


class Harness:
    def __init__(self, client: TestClient, engine: Engine) -> None:
        self.client = client
        self.engine = engine

    def upload(self, content: bytes, purpose: str = "batch", headers: dict[str, str] = AUTH,
               filename: str = "requests.jsonl") -> Any:
        return self.client.post("/v1/files", files={"file": (filename, content, "application/jsonl")},
                                data={"purpose": purpose}, headers=headers)

    def files(self) -> int:
        with self.engine.connect() as connection:
            return int(connection.scalar(select(func.count()).select_from(File)) or 0)


@pytest.fixture
def api(committed: Engine) -> Iterator[Harness]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY, "sk-other"],
                      jobs_poll_interval=0.05, jobs_max_items=5, jobs_max_bytes=4000)
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=ScriptedLM()))
    with TestClient(app) as client:
        yield Harness(client, committed)


def test_upload_read_download_list_delete(api: Harness) -> None:
    content = _jsonl(_request("a"), _request("b"))
    created = api.upload(content)
    assert created.status_code == 200, created.text
    view = created.json()
    assert set(view) == {"id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status",
                         "status_details"}
    assert view["id"].startswith("file-") and view["object"] == "file" and view["bytes"] == len(content)
    assert view["filename"] == "requests.jsonl" and view["purpose"] == "batch" and view["status"] == "processed"
    assert api.client.get(f"/v1/files/{view['id']}", headers=AUTH).json() == view

    download = api.client.get(f"/v1/files/{view['id']}/content", headers=AUTH)
    assert download.status_code == 200 and download.content == content
    assert 'filename="requests.jsonl"' in download.headers["content-disposition"]

    inputs = api.upload(_jsonl({"custom_id": "x", "input": "text"}), purpose="user_data", filename="in.jsonl")
    assert inputs.status_code == 200 and inputs.json()["purpose"] == "user_data"
    listing = api.client.get("/v1/files", headers=AUTH).json()
    assert listing["object"] == "list" and [f["id"] for f in listing["data"]] == [inputs.json()["id"], view["id"]]
    assert listing["first_id"] == inputs.json()["id"] and listing["last_id"] == view["id"]
    assert not listing["has_more"]
    only_batch = api.client.get("/v1/files", params={"purpose": "batch"}, headers=AUTH).json()
    assert [f["id"] for f in only_batch["data"]] == [view["id"]]
    oldest = api.client.get("/v1/files", params={"order": "asc", "limit": 1}, headers=AUTH).json()
    assert [f["id"] for f in oldest["data"]] == [view["id"]] and oldest["has_more"]
    nxt = api.client.get("/v1/files", params={"order": "asc", "after": view["id"]}, headers=AUTH).json()
    assert [f["id"] for f in nxt["data"]] == [inputs.json()["id"]]

    deleted = api.client.delete(f"/v1/files/{view['id']}", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json() == {"id": view["id"], "object": "file", "deleted": True}
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        gone = api.client.request(method, f"/v1/files/{view['id']}{path}", headers=AUTH)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_not_found"


def test_files_belong_to_their_key(api: Harness) -> None:
    file_id = api.upload(_jsonl(_request("a"))).json()["id"]
    assert api.client.get(f"/v1/files/{file_id}", headers=OTHER).status_code == 404
    assert api.client.get(f"/v1/files/{file_id}/content", headers=OTHER).status_code == 404
    assert api.client.delete(f"/v1/files/{file_id}", headers=OTHER).status_code == 404
    assert api.client.get("/v1/files", headers=OTHER).json()["data"] == []
    assert api.client.get("/v1/files").status_code == 401
    assert api.upload(_jsonl(_request("a")), headers={}).status_code == 401


def test_a_user_data_file_feeds_a_job(api: Harness) -> None:
    file_id = api.upload(_jsonl({"custom_id": "r1", "input": "great"}, {"custom_id": "r2", "input": "awful"}),
                         purpose="user_data").json()["id"]
    job = api.client.post("/v1/jobs", json={"pipeline": "review-compare", "input_file_id": file_id}, headers=AUTH)
    assert job.status_code == 201, job.text
    assert job.json()["counts"]["total"] == 2 and job.json()["input_file_id"] == file_id


BAD_UPLOADS = [
    (_jsonl(_request("a"), "{oops"), "batch", 400, "line 2 is not valid JSON"),
    (_jsonl(_request("a"), _request("a")), "batch", 400, "duplicate custom_id 'a'"),
    (_jsonl(_request("a", method="GET")), "batch", 400, "method must be 'POST'"),
    (_jsonl(_request("a", url="/v1/responses")), "batch", 400, "url '/v1/responses' is not supported"),
    (_jsonl(_request("a", body="hello")), "batch", 400, "body must be a JSON object"),
    (_jsonl({"method": "POST", "url": "/v1/completions", "body": {}}), "batch", 400, "custom_id must be"),
    (_jsonl({**_request("a"), "custom_id": 7}), "batch", 400, "custom_id must be"),
    (_jsonl("[1, 2]"), "batch", 400, "not a JSON object"),
    (b"\n\n", "batch", 400, "no requests"),
    (b"\xff\xfe", "batch", 400, "not UTF-8"),
    (_jsonl(_request("a")), "fine-tune", 400, "purpose 'fine-tune' is not accepted"),
    (_jsonl({"custom_id": "a", "input": 1}, {"custom_id": "a", "input": 2}), "user_data", 400, "duplicate"),
    (_jsonl(*[_request(str(i)) for i in range(6)]), "batch", 413, "at most 5 are accepted"),
    (_jsonl(*[_request(f"{i}-" + "x" * 200) for i in range(5)]) + b" " * 3000, "batch", 413, "at most 4000 bytes"),
]


@pytest.mark.parametrize(("content", "purpose", "status", "message"), BAD_UPLOADS)
def test_bad_uploads_write_nothing(api: Harness, content: bytes, purpose: str, status: int, message: str) -> None:
    response = api.upload(content, purpose=purpose)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"], error
    assert api.files() == 0


def test_malformed_uploads(api: Harness) -> None:
    no_file = api.client.post("/v1/files", data={"purpose": "batch"}, headers=AUTH)
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    no_purpose = api.client.post("/v1/files", files={"file": ("a.jsonl", _jsonl(_request("a")))}, headers=AUTH)
    assert no_purpose.status_code == 400 and no_purpose.json()["error"]["param"] == "purpose"
    as_json = api.client.post("/v1/files", json={"purpose": "batch"}, headers=AUTH)
    assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
    # refused from its declared length, before the body is read
    huge = api.upload(b"x" * (4000 + 70 * 1024))
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
    assert api.files() == 0
