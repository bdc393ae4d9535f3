"""A real `inf-engine serve` process is SIGKILLed in the middle of a job and started again: the job completes
and no node whose result was stored runs again (the fake endpoint counts every call), on PostgreSQL and on
SQLite (the embedded default)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from app.db import NodeResult, create_db_engine
from app.db.migrate import upgrade
from app.testing.fake_llm_server import start_fake_server_process, stop_fake_server_process
from tests.support.postgres import temporary_database

ROOT = Path(__file__).resolve().parents[3]
ITEMS = 20
LLM_NODES = 3 * ITEMS  # praise, complaints and verdict per review


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def fake_endpoint() -> Iterator[str]:
    proc, base_url = start_fake_server_process(latency=0.15)
    try:
        yield base_url
    finally:
        stop_fake_server_process(proc)


class ServerProcess:
    def __init__(self, env: dict[str, str], port: int) -> None:
        self.env, self.port = env, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)],
                                     cwd=ROOT, env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited while starting"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def _stats(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url.removesuffix("/v1") + "/_stats").json()


@contextmanager
def _database(kind: str, tmp_path: Path) -> Iterator[str]:
    """A migrated database: a scratch PostgreSQL one, or an SQLite file (the embedded default)."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'kill.db'}"
        upgrade(url)
        yield url
        return
    with temporary_database("infe_kill") as url:
        upgrade(url)
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgres", "sqlite"])
def test_server_killed_mid_job_resumes_without_rerunning_stored_nodes(
    fake_endpoint: str, tmp_path: Path, database: str
) -> None:
    resources = tmp_path / "resources.toml"
    resources.write_text(
        f'[endpoints.assistant]\nprovider = "openai"\nmodel = "m"\nbase_url = "{fake_endpoint}"\n'
        'api_key = "sk-x"\nmax_concurrent = 4\n'
    )
    with _database(database, tmp_path) as url:
        env = {
            **os.environ,
            "INF_ENGINE_DATABASE_URL": url,
            "INF_ENGINE_RESOURCES_FILE": str(resources),
            "INF_ENGINE_BACKEND": "openai",  # the OpenAI routes proxy to the fake endpoint: no model to load
            "INF_ENGINE_OPENAI_BASE_URL": fake_endpoint,
            "INF_ENGINE_OPENAI_MODEL": "m",
            "INF_ENGINE_JOBS_POLL_INTERVAL": "0.1",
            "INF_ENGINE_DATA_DIR": str(tmp_path / "data"),
        }
        env.pop("INF_ENGINE_API_KEYS", None)
        server = ServerProcess(env, _free_port())
        engine = create_db_engine(url)
        stored_llm = select(func.count()).select_from(NodeResult).where(NodeResult.node_id.like("LLMInference%"))
        try:
            server.start()
            inputs = [{"custom_id": f"k{i}", "input": {"review": f"kill test review {i}"}} for i in range(ITEMS)]
            job = httpx.post(f"{server.url}/v1/jobs", json={"pipeline": "review-compare", "inputs": inputs}).json()
            deadline = time.monotonic() + 30
            while True:  # kill once some nodes are stored and many are not
                with engine.connect() as connection:
                    stored = int(connection.scalar(stored_llm) or 0)
                if stored >= 12:
                    break
                assert time.monotonic() < deadline, "no node results were stored"
                time.sleep(0.05)
            server.kill()
            with engine.connect() as connection:
                stored = int(connection.scalar(stored_llm) or 0)
            assert 0 < stored < LLM_NODES
            time.sleep(0.3)  # requests the dead server had in flight finish on the fake endpoint
            httpx.post(fake_endpoint.removesuffix("/v1") + "/_reset")

            server.start()
            deadline = time.monotonic() + 60
            while True:
                view = httpx.get(f"{server.url}/v1/jobs/{job['id']}").json()
                if view["status"] in {"completed", "failed", "cancelled"}:
                    break
                assert time.monotonic() < deadline, view
                time.sleep(0.1)
            assert view["status"] == "completed", view
            assert view["counts"]["completed"] == ITEMS
            calls_after_restart = _stats(fake_endpoint)["total"]
            # every stored node was loaded, not re-run; every other node ran exactly once
            assert calls_after_restart == LLM_NODES - stored, (calls_after_restart, stored)
            results = httpx.get(f"{server.url}/v1/jobs/{job['id']}/results").text.splitlines()
            assert sorted(json.loads(line)["custom_id"] for line in results) == sorted(i["custom_id"] for i in inputs)
            with engine.connect() as connection:
                assert int(connection.scalar(stored_llm) or 0) == LLM_NODES
        finally:
            server.stop()
            engine.dispose()
