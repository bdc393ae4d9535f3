"""Real Celery processes for the worker tests: ``inf-engine worker``/``flower``/``beat`` as subprocesses on the
loopback Redis, each test run with its own key and queue prefix (so parallel runs and other tests never meet)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.support.redisdb import SERVER, client, temporary_prefix

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as exc:  # not up yet
            last_error = exc
        else:
            if value:
                return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_error})")


class Platform:
    """Environment and processes of one test run: everything it starts is stopped at the end."""

    def __init__(self, prefix: str, tmp: Path) -> None:
        self.prefix = prefix
        self.tmp = tmp
        self.env = {
            **os.environ,
            "INF_ENGINE_REDIS_URL": SERVER,
            "INF_ENGINE_REDIS_PREFIX": prefix,
            "INF_ENGINE_CELERY_QUEUE_PREFIX": prefix,
            "INF_ENGINE_DATA_DIR": str(tmp / "data"),
            "INF_ENGINE_FLOWER_USER": "tester",
            "INF_ENGINE_FLOWER_PASSWORD": "s3cret:pw",
            "INF_ENGINE_LOG_LEVEL": "INFO",
        }
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    @property
    def settings(self) -> Settings:
        return Settings(redis_url=SERVER, redis_prefix=self.prefix, celery_queue_prefix=self.prefix)

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{args[0]}-{len(self.procs)}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", *args],
                cwd=ROOT,
                env=self.env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its pool children go down with it
            )
        self.procs.append((proc, log))
        return proc

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return next(log.read_text(errors="replace") for p, log in self.procs if p is proc)

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            self.stop(proc)


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[Platform]:
    client()  # a clear error when Redis is down
    with temporary_prefix("infe_workers") as prefix:
        run = Platform(prefix, tmp_path)
        try:
            yield run
        finally:
            run.stop_all()
