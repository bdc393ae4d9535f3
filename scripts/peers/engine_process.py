"""One engine's worker process for ``scripts/bench_engine.py``, kept loaded and driven over stdin/stdout.

Standard library only. The worker (ours: ``bench_engine.py --worker ...``; peers: ``vllm_offline.py``,
``llamacpp_offline.py``) prints a ready line, then answers each ``<workload> [<repeat>]`` line with one JSON
row. ``engine`` is the column the worker's rows will carry, so that a worker that fails to start or dies
still has its column (with the error) in the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class EngineProcess:
    """One engine's worker process, kept alive for the whole run and driven one workload at a time over stdin.

    All engines stay loaded side by side (vLLM takes minutes to start) and take turns: each workload runs on
    every engine in a row, and the whole sequence is repeated, so slow phases of a shared machine hit every
    engine alike instead of one engine's whole run. While one engine runs, the others are stopped (SIGSTOP on
    their process groups): an idle vLLM keeps polling on both cores (about 6% each of its processes), which
    would slow whichever engine runs beside it. Stdout carries JSON lines; stderr is passed through.
    """

    def __init__(self, label: str, engine: str, cmd: list[str]) -> None:
        self.label = label  # for the log
        self.engine = engine  # the table column its rows carry
        self.error: str | None = None  # why it is not ready, or why its last workload gave no row
        print(f"--- {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
        )

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        """Stop every process of this engine (its own and those it started) until :meth:`resume`."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _read_row(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON line from the worker, or None if it exits or takes longer than ``timeout``."""
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        return dict(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        finally:
            timer.cancel()
        print(f"--- {self.label}: worker ended (exit code {self.proc.poll()})", file=sys.stderr, flush=True)
        return None

    def wait_ready(self, timeout: float) -> bool:
        row = self._read_row(timeout)
        if row is not None and row.get("ready"):
            return True
        if row is not None and row.get("error"):
            self.error = str(row["error"])
        else:
            self.error = f"worker ended or timed out before it was ready (exit code {self.proc.poll()})"
        return False

    def run(self, name: str, timeout: float) -> dict[str, Any] | None:
        """The worker's row for workload command ``name`` ("<workload> <repeat>"): a result, or an error row
        (``{"engine", "workload", "error"}``) where the worker reported one; None (and :attr:`error` set)
        where it gave no row at all."""
        self.error = None
        if self.proc.poll() is not None or self.proc.stdin is None:
            self.error = f"worker not running (exit code {self.proc.poll()})"
            return None
        try:
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.error = "worker not running (broken pipe)"
            return None
        row = self._read_row(timeout)
        if row is None:
            self.error = f"worker ended or timed out (exit code {self.proc.poll()})"
            return None
        if "error" in row:
            print(f"--- {self.label}: {row['error']}", file=sys.stderr, flush=True)
            if "workload" not in row:
                self.error = str(row["error"])
                return None
            row["engine"] = self.engine
        return row

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
