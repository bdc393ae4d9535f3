"""The ``inf-engine`` command as a user runs it (the venv's script, else ``python -m app.cli``), and a server it
started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def cli() -> list[str]:
    script = Path(sys.executable).with_name("inf-engine")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "app.cli"]


class Served:
    """An ``inf-engine serve`` process, its port and its log file."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float = 90) -> None:
    """Until ``/health`` answers 200; fails the test with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"inf-engine serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"inf-engine serve did not become healthy:\n{log.read_text()}")
        time.sleep(0.2)
