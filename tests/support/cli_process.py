"""The ``inf-engine`` command as a user runs it (the venv's script, else ``python -m app.cli``), and a server it
started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
