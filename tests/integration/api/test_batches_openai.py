"""The OpenAI Batch API end to end with the official ``openai`` client, unchanged, against a real uvicorn server
on PostgreSQL. The server's own backend (a fake one: fast, deterministic) is the model, as in ``inf-engine serve``
without a resources file."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from sqlalchemy import Engine, func, select, update

from api.main import create_app
from app.db import Batch, File, Job
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend

KEY = "sk-batch-test"


def _line(custom_id: str, content: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    if url == "/v1/completions":
        payload = {"model": "anything", "prompt": content, **body}
    else:
        payload = {"model": "anything", "messages": [{"role": "user", "content": content}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": payload}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


class Server:
    def __init__(self, thread: ServerThread, engine: Engine, backend: FakeBackend) -> None:
        self.thread = thread
        self.engine = engine
        self.backend = backend
        self.client = openai.OpenAI(api_key=KEY, base_url=thread.base_url, max_retries=0, timeout=30)

    def upload(self, lines: list[dict[str, Any]], name: str = "requests.jsonl") -> Any:
        return self.client.files.create(file=(name, _jsonl(lines)), purpose="batch")

    def wait(self, batch_id: str, statuses: set[str], timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            batch = self.client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)

    def lines_of(self, file_id: str | None) -> dict[str, dict[str, Any]]:
        assert file_id is not None
        text = self.client.files.content(file_id).text
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return {row["custom_id"]: row for row in rows}

    def count(self, model: Any) -> int:
        with self.engine.connect() as connection:
            return int(connection.scalar(select(func.count()).select_from(model)) or 0)


def _server(engine: Engine, *, resources: Any = None, **settings: Any) -> Iterator[Server]:
    options = {"database_url": engine.url.render_as_string(hide_password=False), "api_keys": [KEY],
               "jobs_poll_interval": 0.05, **settings}
    config = Settings(**options)
    backend = FakeBackend()
    jobs = JobsRuntime(config, resources=resources) if resources is not None else None
    with ServerThread(create_app(config, backend=backend, jobs=jobs)) as thread:
        server = Server(thread, engine, backend)
        try:
            yield server
        finally:
            server.client.close()


@pytest.fixture
def server(committed: Engine) -> Iterator[Server]:
    yield from _server(committed)


def test_openai_client_batch_flow(server: Server) -> None:
    lines = [_line(f"req-{i}", f"question number {i}", max_tokens=40, temperature=0.5) for i in range(4)]
    uploaded = server.upload(lines)
    assert uploaded.id.startswith("file-") and uploaded.object == "file" and uploaded.purpose == "batch"
    assert uploaded.bytes == len(_jsonl(lines)) and uploaded.filename == "requests.jsonl"
    assert server.client.files.retrieve(uploaded.id).id == uploaded.id
    assert server.client.files.content(uploaded.id).content == _jsonl(lines)

    batch = server.client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"run": "nightly"})
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert batch.status in {"validating", "in_progress"} and batch.request_counts.total == 4
    assert batch.metadata == {"run": "nightly"} and batch.input_file_id == uploaded.id
    assert batch.expires_at == batch.created_at + 24 * 3600 and batch.completion_window == "24h"

    done = server.wait(batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 4, "completed": 4, "failed": 0}
    assert done.error_file_id is None and done.errors is None
    assert done.in_progress_at is not None and done.finalizing_at is not None and done.completed_at is not None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is None and done.cancelled_at is None and done.expired_at is None

    outputs = server.lines_of(done.output_file_id)
    assert sorted(outputs) == [f"req-{i}" for i in range(4)]
    first = outputs["req-0"]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200 and first["response"]["request_id"]
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    # FakeBackend echoes the prompt's last 12 characters
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "echo: ion number 0"}
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] >= len("echo: ion number 0") and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # the line's sampling fields reached the model
    assert {r.params.max_tokens for r in server.backend.requests} == {40}
    assert {r.params.temperature for r in server.backend.requests} == {0.5}

    output_file = server.client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.filename == f"{batch.id}_output.jsonl"

    listing = server.client.batches.list()
    assert [b.id for b in listing.data] == [batch.id] and listing.data[0].status == "completed"
    # reading again changes nothing: the files are written once
    again = server.client.batches.retrieve(batch.id)
    assert again.output_file_id == done.output_file_id and server.count(File) == 2


def test_error_file_for_failing_lines(server: Server) -> None:
    lines = [
        _line("good-1", "hello there"),
        # an empty role is refused by the model's request checks (a 400 for this request only)
        {"custom_id": "bad-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "", "content": "hi"}]}},
        _line("good-2", "general kenobi"),
    ]
    batch = server.client.batches.create(input_file_id=server.upload(lines).id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    done = server.wait(batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    assert sorted(server.lines_of(done.output_file_id)) == ["good-1", "good-2"]
    errors = server.lines_of(done.error_file_id)
    assert list(errors) == ["bad-1"]
    assert errors["bad-1"]["response"] is None
    assert errors["bad-1"]["error"]["code"] == "resource_error" and "role" in errors["bad-1"]["error"]["message"]
    assert server.client.files.retrieve(done.error_file_id).filename == f"{batch.id}_error.jsonl"


def test_completions_endpoint(server: Server) -> None:
    lines = [_line("c1", "Once upon a time", url="/v1/completions", max_tokens=8)]
    batch = server.client.batches.create(input_file_id=server.upload(lines).id, endpoint="/v1/completions",
                                         completion_window="24h")
    done = server.wait(batch.id, {"completed", "failed"})
    body = server.lines_of(done.output_file_id)["c1"]["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "echo:  upon a time"[:8]
    assert body["choices"][0]["finish_reason"] == "length"


def test_lines_that_do_not_fit_the_endpoint_fail_the_batch(server: Server) -> None:
    lines = [_line("a", "x"), _line("b", "y", url="/v1/completions"), _line("c", "z", n=3)]
    batch = server.client.batches.create(input_file_id=server.upload(lines).id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.object == "list"
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [
        ("mismatched_endpoint", 2, "url"), ("unsupported_value", 3, "body.n")]
    assert batch.request_counts.total == 0 and batch.output_file_id is None
    assert server.count(Job) == 0  # nothing runs
    assert server.client.batches.retrieve(batch.id).status == "failed"


class HangingLM(ScriptedLM):
    """Answers requests whose text holds "fast"; every other request hangs until it is cancelled."""

    async def complete(self, alias: str, request: Any) -> Any:
        if "fast" not in json.dumps(request.prompt):
            import asyncio

            await asyncio.Event().wait()
        return await super().complete(alias, request)


def test_cancel_keeps_what_finished(committed: Engine) -> None:
    for server in _server(committed, resources=HangingLM()):
        lines = [_line("fast-1", "fast one"), _line("slow-1", "slow"), _line("slow-2", "slow")]
        batch = server.client.batches.create(input_file_id=server.upload(lines).id,
                                             endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 10
        while server.client.batches.retrieve(batch.id).request_counts.completed < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelling = server.client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        assert server.client.batches.cancel(batch.id).status == "cancelling"  # twice is harmless
        done = server.wait(batch.id, {"cancelled"})
        assert done.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 0}
        assert done.cancelled_at is not None and done.completed_at is None
        assert list(server.lines_of(done.output_file_id)) == ["fast-1"]
        errors = server.lines_of(done.error_file_id)
        assert sorted(errors) == ["slow-1", "slow-2"]
        assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
        with pytest.raises(openai.ConflictError, match="only a validating or in-progress batch"):
            server.client.batches.cancel(batch.id)


def test_expired_batch(committed: Engine) -> None:
    for server in _server(committed, resources=HangingLM()):
        lines = [_line("fast-1", "fast"), _line("slow-1", "slow")]
        batch = server.client.batches.create(input_file_id=server.upload(lines).id,
                                             endpoint="/v1/chat/completions", completion_window="24h")
        server.wait(batch.id, {"in_progress"})
        with committed.begin() as connection:  # the 24 hours have passed
            connection.execute(update(Batch).where(Batch.id == batch.id)
                               .values(expires_at=Batch.created_at))
        done = server.wait(batch.id, {"expired"})
        assert done.expired_at is not None and done.cancelled_at is None
        errors = server.lines_of(done.error_file_id)
        assert errors["slow-1"]["error"]["code"] == "batch_expired"


def test_list_batches_pages(server: Server) -> None:
    file_id = server.upload([_line("a", "x", url="/v1/completions")]).id
    ids = [server.client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h").id for _ in range(3)]
    page = server.client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = server.client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id for b in server.client.batches.list(limit=2)] == ids[::-1]  # the client follows the pages


def test_bad_batch_requests_write_nothing(server: Server) -> None:
    file_id = server.upload([_line("a", "x")]).id
    jobs_file = server.client.files.create(file=("in.jsonl", b'{"custom_id": "a", "input": "x"}\n'),
                                           purpose="user_data").id
    cases = [
        ({"input_file_id": file_id, "endpoint": "/v1/responses", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "48h"},
         "completion_window"),
        ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
         "input_file_id"),
        ({"input_file_id": jobs_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
         "input_file_id"),
        ({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
          "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            server.client.batches.create(**arguments)
        assert caught.value.status_code == 400 and caught.value.param == param, caught.value
    assert server.count(Batch) == 0 and server.count(Job) == 0
    with pytest.raises(openai.NotFoundError):
        server.client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        server.client.batches.cancel("batch_nope")
