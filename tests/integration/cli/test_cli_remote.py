"""`inf-engine jobs list|get|cancel|trace`, `inf-engine files ...` and `inf-engine batches ...` against a real server
(uvicorn on 127.0.0.1, PostgreSQL), and shell completion."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from typer.testing import CliRunner

from api.main import create_app
from app.cli import app
from app.client import Client
from app.jobs.runtime import JobsRuntime
from app.pipeline.resources.types import LLMRequest, LLMResponse
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.postgres import committed, pg_engine, pg_url
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend

__all__ = ["committed", "pg_engine", "pg_url"]  # fixtures

KEY = "acme:sk-cli-remote"
runner = CliRunner()


class HangingLM(ScriptedLM):
    """A prompt with "slow" in it waits until it is cancelled; the others are answered at once."""

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        if "slow" in json.dumps(request.prompt):
            await asyncio.Event().wait()
        return await super().complete(alias, request)


@pytest.fixture
def server(committed: Engine) -> Iterator[ServerThread]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=[KEY],
                      jobs_poll_interval=0.05)
    application = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=HangingLM()))
    with ServerThread(application) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.root, api_key=KEY) as client:
        yield client


def _cli(server: ServerThread, *args: str) -> Any:
    return runner.invoke(app, [*args, "--url", server.root, "--api-key", KEY])


def test_jobs_get_cancel_trace(server: ServerThread, client: Client, tmp_path: Path) -> None:
    done = client.jobs.submit("sentiment", ["Great phone"])
    client.jobs.wait(done.id, poll_interval=0.05, timeout=20)
    shown = _cli(server, "jobs", "get", done.id)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["id"] == done.id and json.loads(shown.stdout)["status"] == "completed"
    # the group's --url/--api-key reach its subcommands too
    grouped = runner.invoke(app, ["jobs", "--url", server.root, "--api-key", KEY, "get", done.id])
    assert grouped.exit_code == 0 and json.loads(grouped.stdout)["id"] == done.id
    listed = _cli(server, "jobs", "list", "--json", "--status", "completed")
    assert [j["id"] for j in json.loads(listed.stdout)["data"]] == [done.id]

    traced = _cli(server, "jobs", "trace", done.id)
    assert traced.exit_code == 0 and json.loads(traced.stdout)["traceEvents"]
    out = tmp_path / "job.trace.json"
    written = _cli(server, "jobs", "trace", done.id, "--output", str(out))
    assert written.exit_code == 0 and "perfetto" in written.stderr
    assert json.loads(out.read_text())["traceEvents"]

    hanging = client.jobs.submit("sentiment", ["a slow review", "another slow one"])
    cancelled = _cli(server, "jobs", "cancel", hanging.id, "--wait")
    assert cancelled.exit_code == 0, cancelled.output
    assert json.loads(cancelled.stdout)["status"] == "cancelled" and "0/2 completed, 2 cancelled" in cancelled.stderr

    finished = _cli(server, "jobs", "cancel", done.id)
    assert finished.exit_code == 2 and "HTTP 409" in finished.stderr and "nothing to cancel" in finished.stderr
    missing = _cli(server, "jobs", "trace", "job_nope")
    assert missing.exit_code == 2 and "HTTP 404" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_files_commands(server: ServerThread, tmp_path: Path) -> None:
    source = tmp_path / "items.jsonl"
    source.write_text('{"custom_id": "a", "input": "Great"}\n')
    uploaded = _cli(server, "files", "upload", str(source), "--purpose", "user_data")
    assert uploaded.exit_code == 0, uploaded.output
    file_id = uploaded.stdout.strip()
    assert file_id.startswith("file-") and "items.jsonl" in uploaded.stderr

    listed = _cli(server, "files", "list")
    assert listed.exit_code == 0 and file_id in listed.stdout and "user_data" in listed.stdout
    assert [f["id"] for f in json.loads(_cli(server, "files", "list", "--json").stdout)["data"]] == [file_id]
    assert json.loads(_cli(server, "files", "list", "--json", "--purpose", "batch").stdout)["data"] == []
    assert json.loads(_cli(server, "files", "get", file_id).stdout)["filename"] == "items.jsonl"
    assert _cli(server, "files", "content", file_id).stdout == source.read_text()
    copy = tmp_path / "copy.jsonl"
    assert _cli(server, "files", "content", file_id, "-o", str(copy)).exit_code == 0
    assert copy.read_bytes() == source.read_bytes()

    deleted = _cli(server, "files", "delete", file_id)
    assert deleted.exit_code == 0 and json.loads(deleted.stdout) == {"id": file_id, "object": "file", "deleted": True}
    gone = _cli(server, "files", "get", file_id)
    assert gone.exit_code == 2 and "HTTP 404" in gone.stderr
    nothing = _cli(server, "files", "upload", str(tmp_path / "none.jsonl"))
    assert nothing.exit_code == 2 and "does not exist" in nothing.stderr


def test_batches_commands(server: ServerThread, client: Client, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}}) + "\n" for i in range(2)))
    created = _cli(server, "batches", "create", "--input", str(requests), "--metadata", "run=nightly")
    assert created.exit_code == 0, created.output
    batch_id = created.stdout.strip()
    assert batch_id.startswith("batch_") and "2 requests to /v1/chat/completions" in created.stderr
    deadline = time.monotonic() + 20
    while client.batches.get(batch_id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shown = json.loads(_cli(server, "batches", "get", batch_id).stdout)
    assert shown["status"] == "completed" and shown["metadata"] == {"run": "nightly"}
    listed = _cli(server, "batches", "list")
    assert listed.exit_code == 0 and batch_id in listed.stdout and "2/2" in listed.stdout
    output = _cli(server, "files", "content", shown["output_file_id"]).stdout
    assert sorted(json.loads(line)["custom_id"] for line in output.splitlines()) == ["r0", "r1"]

    again = _cli(server, "batches", "create", "--input-file-id", shown["input_file_id"], "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["input_file_id"] == shown["input_file_id"]
    assert [b["id"] for b in json.loads(_cli(server, "batches", "list", "--json").stdout)["data"]][1] == batch_id

    finished = _cli(server, "batches", "cancel", batch_id)
    assert finished.exit_code == 2 and "HTTP 409" in finished.stderr
    neither = _cli(server, "batches", "create")
    assert neither.exit_code == 2 and "--input" in neither.stderr
    bad_tag = _cli(server, "batches", "create", "--input-file-id", "file-x", "--metadata", "novalue")
    assert bad_tag.exit_code == 2 and "KEY=VALUE" in bad_tag.stderr


def test_shell_completion() -> None:
    command = [sys.executable, "-m", "app.cli"]
    script = subprocess.run([*command, "--show-completion", "bash"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "complete" in script.stdout, script.stderr
    env = {**os.environ, "_INF_ENGINE_COMPLETE": "complete_bash", "COMP_WORDS": "inf-engine jobs ",
           "COMP_CWORD": "2"}
    words = subprocess.run([sys.executable, "-c", "import sys; from app.cli import main; sys.argv[0] = 'inf-engine'; "
                            "main()"], env=env, capture_output=True, text=True, timeout=60)
    assert {"list", "get", "cancel", "trace"} <= set(words.stdout.split()), (words.stdout, words.stderr)
