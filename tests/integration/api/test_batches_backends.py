"""Batches on the other configurations: the embedded SQLite default, and a resources file that sends the
``batch`` alias to an OpenAI-compatible server over HTTP (the fake one)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from api.main import create_app
from app.settings import Settings
from app.testing.fake_llm_server import FakeLLMServer
from tests.support.serving_fakes import FakeBackend


def _requests(*contents: str) -> bytes:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], "max_tokens": 9}}
             for i, text in enumerate(contents)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _run_batch(client: openai.OpenAI, content: bytes) -> Any:
    file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 20
    while batch.status not in {"completed", "failed", "cancelled", "expired"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    return batch


def _lines(client: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    assert file_id is not None
    rows = [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]
    return {row["custom_id"]: row for row in rows}


@pytest.fixture
def sqlite_client(tmp_path: Path) -> Iterator[openai.OpenAI]:
    config = Settings(data_dir=tmp_path / "state", jobs_poll_interval=0.05)
    with TestClient(create_app(config, backend=FakeBackend())) as http:
        client = openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http, max_retries=0)
        yield client


def test_batch_on_embedded_sqlite(sqlite_client: openai.OpenAI, tmp_path: Path) -> None:
    done = _run_batch(sqlite_client, _requests("first question", "second question"))
    assert done.status == "completed" and done.request_counts.completed == 2
    outputs = _lines(sqlite_client, done.output_file_id)
    assert outputs["r1"]["response"]["body"]["choices"][0]["message"]["content"] == "echo: ond question"[:9]
    assert (tmp_path / "state" / "inf-engine.db").exists()
    assert [b.id for b in sqlite_client.batches.list().data] == [done.id]
    with pytest.raises(openai.ConflictError):
        sqlite_client.batches.cancel(done.id)


def test_batch_through_a_resources_file(committed: Engine, tmp_path: Path) -> None:
    with FakeLLMServer(model="upstream-model") as upstream:
        resources = tmp_path / "resources.toml"
        resources.write_text(f'[endpoints.batch]\nprovider = "openai"\nmodel = "upstream-model"\n'
                             f'base_url = "{upstream.base_url}"\n')
        config = Settings(database_url=committed.url.render_as_string(hide_password=False), resources_file=resources,
                          jobs_poll_interval=0.05)
        with TestClient(create_app(config, backend=FakeBackend())) as http:
            client = openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http,
                                   max_retries=0)
            done = _run_batch(client, _requests("hello upstream", "refuse me [[status:400]]"))
            outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
        stats = upstream.stats()
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    body = outputs["r0"]["response"]["body"]
    assert body["model"] == "upstream-model" and body["choices"][0]["message"]["content"] == "echo: hello upstream"
    assert errors["r1"]["error"]["code"] == "resource_error" and "400" in errors["r1"]["error"]["message"]
    assert stats["by_status"] == {"200": 1, "400": 1}


def test_resources_file_without_the_batch_alias_fails_the_batch(committed: Engine, tmp_path: Path) -> None:
    resources = tmp_path / "resources.toml"
    resources.write_text('[endpoints.other]\nprovider = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), resources_file=resources,
                      jobs_poll_interval=0.05)
    with TestClient(create_app(config, backend=FakeBackend())) as http:
        client = openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http, max_retries=0)
        done = _run_batch(client, _requests("anything"))
        assert done.status == "failed" and done.errors is not None
        (error,) = done.errors.data
        assert error.code == "configuration_error" and "batch" in (error.message or "")
        assert _lines(client, done.error_file_id)["r0"]["error"]["code"] == "configuration_error"
