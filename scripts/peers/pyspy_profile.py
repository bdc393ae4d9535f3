"""A py-spy profile of running processes during a benchmark phase, summarised as shares of samples.

py-spy samples the threads that are not idle (``--nonblocking``: without pausing the process), so the shares
are of the time the process spent working or waiting on locks, not of wall time. ``record`` needs py-spy on
PATH or beside this Python (``pip install py-spy``) and the right to trace the process (root, or ptrace).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# (label, substring of a frame): the share of samples whose stack holds such a frame
AREAS = (
    ("node task body (run_node)", "run_node ("),
    ("  claims (_claim)", "_claim ("),
    ("  stores (store_result)", "store_result ("),
    ("  waiting for a group commit", "execute (app/db/group_commit.py"),
    ("  waiting for a call slot", "take_call_slot ("),
    ("group committer thread", "_loop (app/db/group_commit.py"),
    ("event loop: HTTP client (aiohttp)", "aiohttp"),
    ("event loop: asyncio", "asyncio"),
    ("kombu (broker messages)", "kombu"),
    ("redis client", "redis"),
    ("celery (consumer, pool, ack)", "celery"),
    ("psycopg", "psycopg"),
)


def py_spy_path() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@contextmanager
def recording(pids: list[int], out_dir: Path, enabled: bool = True) -> Iterator[list[Path]]:
    """Record each of ``pids`` (and its children) while the block runs; yields the raw profiles' paths."""
    exe = py_spy_path() if enabled else None
    if exe is None:
        yield []
        return
    procs, paths = [], []
    for pid in pids:
        path = out_dir / f"py-spy-{pid}.txt"
        command = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--nonblocking",
            "--rate",
            "200",
            "--format",
            "raw",
            "--output",
            str(path),
        ]
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        paths.append(path)
    time.sleep(1.0)  # attached before the phase starts
    try:
        yield paths
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def summarize(path: Path, top: int = 8) -> list[str]:
    """Shares of the samples by area (AREAS) and the functions most often on top of the stack."""
    if not path.exists():
        return [f"  py-spy: no profile at {path}"]
    total = 0
    areas: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        for label, needle in AREAS:
            if needle in stack:
                areas[label] += n
        leaves[stack.rsplit(";", 1)[-1].split(" (")[0]] += n
    if not total:
        return ["  py-spy: no samples"]
    lines = [f"  py-spy: {total} samples; share of samples by area (a sample can fall in several):"]
    lines += [f"    {label:<34} {100 * areas[label] / total:5.1f}%" for label, _ in AREAS]
    lines.append(
        "    top functions (own samples): "
        + ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in leaves.most_common(top))
    )
    return lines
