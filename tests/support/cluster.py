"""A small real platform on loopback for the distributed tests: a throw-away PostgreSQL database, Redis (the
shared one under a unique prefix, or a private server), the fake OpenAI server as its own process, and
``inf-engine worker``/``beat`` processes. The test process plays the API: it submits jobs and dispatches them
exactly as ``/v1/jobs`` does with Redis configured."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, func, select, text

from app.db import Item, create_db_engine, make_session_factory, session_scope
from app.db.models import IN_FLIGHT_SQL, NodeResult, NodeTask
from app.jobs.distributed import dispatch_job
from app.jobs.distributed.transport.celery_dispatch import CeleryDispatcher
from app.jobs.distributed.worker import dispatch_window, endpoints_of, node_policy
from app.jobs.registry import configure_registry
from app.jobs.service import describe_job
from app.jobs.submission import JobRequest, submit_job
from app.settings import Settings
from workers.celery_app import create_celery_app

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"completed", "failed", "cancelled"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as exc:  # not up yet
            last = exc
        else:
            if value:
                return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last})")


class Cluster:
    """Processes and settings of one test; ``close()`` stops everything it started."""

    def __init__(self, tmp: Path, db_url: str, redis_url: str, prefix: str, fake_base_url: str, **extra: str) -> None:
        self.tmp = tmp
        self.db_url = db_url
        self.redis_url = redis_url
        self.prefix = prefix
        self.fake_base_url = fake_base_url  # with /v1
        self.resources = tmp / "resources.toml"
        self.write_resources()
        self.env = {
            **os.environ,
            "INF_ENGINE_DATABASE_URL": db_url,
            "INF_ENGINE_REDIS_URL": redis_url,
            "INF_ENGINE_REDIS_PREFIX": prefix,
            "INF_ENGINE_CELERY_QUEUE_PREFIX": prefix,
            "INF_ENGINE_DATA_DIR": str(tmp / "data"),
            "INF_ENGINE_RESOURCES_FILE": str(self.resources),
            "INF_ENGINE_LOG_LEVEL": "INFO",
            "INF_ENGINE_NODE_LEASE_SECONDS": "3",
            "INF_ENGINE_NODE_STALE_SECONDS": "3",
            "INF_ENGINE_NODE_RETRY_DELAY": "0.2",
            "INF_ENGINE_SWEEP_INTERVAL": "1",
            "INF_ENGINE_PIPELINE_MODULES": "tests.support.pipelines",
            "PYTHONPATH": str(ROOT),
            **extra,
        }
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._engine: Engine | None = None
        self._celery: Any = None
        self._dispatcher: CeleryDispatcher | None = None

    # -- configuration ------------------------------------------------------------------------------------------
    def write_resources(self, **endpoint: Any) -> None:
        lines = ["[endpoints.assistant]", 'provider = "openai"', 'model = "fake-model"',
                 f'base_url = "{self.fake_base_url}"', 'api_key = "test"', "max_retries = 3"]
        lines += [f"{key} = {value!r}" if isinstance(value, str) else f"{key} = {value}" for key, value in endpoint.items()]
        self.resources.write_text("\n".join(lines).replace("'", '"') + "\n")

    @property
    def settings(self) -> Settings:
        env: dict[str, Any] = {
            k[len("INF_ENGINE_"):].lower(): v for k, v in self.env.items() if k.startswith("INF_ENGINE_")
        }
        # a JSON value (a dict or list setting) as the environment source would read it
        env = {k: json.loads(v) if v[:1] in "{[" else v for k, v in env.items()}
        return Settings(**env)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = create_db_engine(self.db_url)
        return self._engine

    @property
    def dispatcher(self) -> CeleryDispatcher:
        if self._dispatcher is None:
            self._celery = create_celery_app(self.settings)
            self._dispatcher = CeleryDispatcher(self._celery, self.settings)
        return self._dispatcher

    # -- processes ----------------------------------------------------------------------------------------------
    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{args[0]}-{len(self.procs)}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", *args], cwd=ROOT, env={**self.env, **(env or {})},
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.procs.append((proc, log))
        return proc

    def start_worker(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A worker consuming every queue of this test, waited for until it answers a ping."""
        node = f"{name}.{self.prefix}@localhost"
        args = args or ("--pool", "threads", "--concurrency", "16")
        proc = self.start("worker", "--queues", "cpu,llm,engine", "--name", node, *args, env=env)
        celery = self.dispatcher.celery
        wait_until(lambda: proc.poll() is None and celery.control.ping(destination=[node], timeout=1.0), 90,
                   f"worker {node} ({self.log_of(proc)[-2000:]})")
        return proc

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return next(log.read_text(errors="replace") for p, log in self.procs if p is proc)

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def close(self) -> None:
        for proc, _ in reversed(self.procs):
            self.stop(proc)
        if self._dispatcher is not None:
            self._dispatcher.close()
            self._dispatcher = None
        if self._celery is not None:
            self._celery.close()
            self._celery = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # -- jobs -------------------------------------------------------------------------------------------------
    def submit(
        self, pipeline: str, inputs: list[Any], dispatch: bool = True, *, owner: str = "anonymous", priority: int = 0
    ) -> str:
        """What ``POST /v1/jobs`` does: one transaction, then the node rows are written and the dispatch windows
        (sized as the API sizes them) refilled after the commit."""
        sessions = make_session_factory(self.engine)
        configure_registry(self.settings.pipeline_modules)  # as the server does at start
        with session_scope(sessions) as session:
            job, _ = submit_job(session, JobRequest(pipeline, inputs=inputs, priority=priority), owner=owner)
        if dispatch:
            settings = self.settings
            endpoints = endpoints_of(settings)
            window = dispatch_window(settings, sessions, self.dispatcher, endpoints)
            dispatch_job(sessions, job.id, self.dispatcher, endpoints, node_policy(settings), window=window)
        return job.id

    def queued_messages(self, kind: str = "llm") -> int:
        """Messages waiting in Redis in one of this test's queues (every priority level)."""
        return self.dispatcher.queue_depth(f"{self.prefix}.{kind}")

    def in_flight_of(self, job_id: str) -> int:
        """The job's node tasks in flight (sent and not claimed yet, or running), counted in one statement as the
        dispatch window counts them: two separate counts could see a node finish and its successor sent between
        them, and count both."""
        with session_scope(make_session_factory(self.engine)) as session:
            stmt = select(func.count()).select_from(NodeTask).where(NodeTask.job_id == job_id, text(IN_FLIGHT_SQL))
            return int(session.scalar(stmt) or 0)

    def unclaimed_sent(self, kind: str = "llm") -> int:
        """Node tasks whose message was sent and not claimed yet (what the dispatch window bounds)."""
        with session_scope(make_session_factory(self.engine)) as session:
            stmt = select(func.count()).select_from(NodeTask).where(
                NodeTask.queue == f"{self.prefix}.{kind}", NodeTask.status == "queued", NodeTask.sent_at.is_not(None))
            return int(session.scalar(stmt) or 0)

    def view(self, job_id: str) -> dict[str, Any]:
        with session_scope(make_session_factory(self.engine)) as session:
            return describe_job(session, job_id)

    def wait(self, job_id: str, timeout: float, interval: float = 0.25) -> dict[str, Any]:
        view: dict[str, Any] = {}

        def done() -> bool:
            nonlocal view
            view = self.view(job_id)
            return view["status"] in TERMINAL

        try:
            wait_until(done, timeout, f"job {job_id} to finish", interval=interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {view}; unfinished nodes: {self.unfinished(job_id)}") from None
        return view

    def assert_exactly_once(self, job_id: str, items: int, nodes_per_item: int) -> None:
        """The job completed with every item in exactly one terminal state (one place each in the completion
        order) and every node stored exactly once: nothing lost, nothing done twice."""
        view = self.view(job_id)
        assert view["status"] == "completed", view
        states = self.item_states(job_id)
        assert len(states) == items and {s for _, s, _ in states} == {"completed"}
        assert sorted(q or 0 for _, _, q in states) == list(range(1, items + 1))
        with session_scope(make_session_factory(self.engine)) as session:
            stored = session.scalar(select(func.count()).select_from(NodeResult).where(NodeResult.job_id == job_id))
        assert stored == nodes_per_item * items
        assert self.node_counts(job_id) == {"done": nodes_per_item * items}

    def unfinished(self, job_id: str) -> list[tuple[Any, ...]]:
        """The job's nodes not stored yet, for a failure message: (item, node, status, attempts, deadline)."""
        with session_scope(make_session_factory(self.engine)) as session:
            stmt = select(NodeTask.item_id, NodeTask.node_id, NodeTask.status, NodeTask.attempts,
                          NodeTask.deadline).where(NodeTask.job_id == job_id, NodeTask.status != "done").limit(20)
            return [tuple(row) for row in session.execute(stmt)]

    def node_counts(self, job_id: str) -> dict[str, int]:
        with session_scope(make_session_factory(self.engine)) as session:
            stmt = select(NodeTask.status, func.count()).where(NodeTask.job_id == job_id).group_by(NodeTask.status)
            return {s: int(n) for s, n in session.execute(stmt)}

    def item_states(self, job_id: str) -> list[tuple[str, str, int | None]]:
        with session_scope(make_session_factory(self.engine)) as session:
            stmt = select(Item.custom_id, Item.status, Item.result_seq).where(Item.job_id == job_id)
            return [(c, s, q) for c, s, q in session.execute(stmt)]

    # -- the fake endpoint ------------------------------------------------------------------------------------
    def fake_stats(self) -> dict[str, Any]:
        root = self.fake_base_url.removesuffix("/v1")
        return dict(httpx.get(f"{root}/_stats", timeout=5).json())

    def fake_control(self, **changes: Any) -> None:
        root = self.fake_base_url.removesuffix("/v1")
        httpx.post(f"{root}/_control", json=changes, timeout=5).raise_for_status()


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")
