"""Per-stage timers of node tasks in one worker process: where a node's milliseconds go.

Every node task adds the wall time and the calling thread's CPU time of each of its stages (claim, load, call,
store, publish, ...) to one process-wide :class:`StageClock`; the cost is two clock reads per stage. A snapshot
also reads the CPU time of the threads that are not task threads (Celery's consumer, the event loop), so the
benchmark can split a node's whole cost between transport, event loop and our own stages, by differencing two
snapshots taken around a run.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from app.db.group_commit import retired_committer_cpu_s

__all__ = ["Lap", "StageClock", "clock", "diff_snapshots"]


@dataclass
class StageClock:
    """Wall and thread-CPU seconds and counts per stage, accumulated over the life of a process."""

    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    # named threads whose CPU time a snapshot reports (thread ident by role, e.g. "consumer", "loop")
    threads: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, stage: str, wall_s: float, cpu_s: float, count: int = 1) -> None:
        with self._lock:  # task threads add concurrently; a lost update would skew the figures
            self.wall[stage] = self.wall.get(stage, 0.0) + wall_s
            self.cpu[stage] = self.cpu.get(stage, 0.0) + cpu_s
            self.count[stage] = self.count.get(stage, 0) + count

    def name_thread(self, role: str, ident: int | None = None) -> None:
        """Report this thread's (or ``ident``'s) CPU time under ``role`` in snapshots."""
        self.threads[role] = ident if ident is not None else threading.get_ident()

    def snapshot(self) -> dict[str, Any]:
        """The totals so far, with the process's CPU time, its threads' and its peak RSS (JSON-able)."""
        with self._lock:
            stages = {s: [self.wall[s], self.cpu[s], self.count[s]] for s in self.wall}
        threads = {}
        for role, ident in list(self.threads.items()):
            try:
                threads[role] = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, AttributeError):  # the thread ended (or no per-thread clocks here)
                continue
        # the node store's committer threads (app.db.group_commit), found by name: the db layer knows no clock
        committers = [t.ident for t in threading.enumerate() if t.name == "group-commit" and t.ident is not None]
        threads["committer"] = retired_committer_cpu_s()  # those that stopped, then the live ones
        for ident in committers:
            try:
                threads["committer"] += time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, AttributeError):
                continue  # it stopped meanwhile: its CPU is in the retired total from now on
        return {
            "pid": os.getpid(),
            "process_cpu_s": time.process_time(),
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "threads": threads,
            "stages": stages,
        }


def diff_snapshots(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after`` minus ``before`` (the same process), peak RSS as of ``after``."""
    stages = {}
    for name, (wall, cpu, count) in after["stages"].items():
        w0, c0, n0 = before["stages"].get(name, [0.0, 0.0, 0])
        stages[name] = [wall - w0, cpu - c0, count - n0]
    return {
        "pid": after["pid"],
        "process_cpu_s": after["process_cpu_s"] - before["process_cpu_s"],
        "peak_rss_kb": after["peak_rss_kb"],
        "threads": {r: t - before["threads"].get(r, 0.0) for r, t in after["threads"].items()},
        "stages": stages,
    }


class Lap:
    """Times consecutive stages of one task on one thread: ``lap("claim")`` closes the stage that began at the
    previous lap (or at creation)."""

    __slots__ = ("_clock", "_cpu", "_wall")

    def __init__(self, clock: StageClock) -> None:
        self._clock = clock
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()

    def __call__(self, stage: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self._clock.add(stage, wall - self._wall, cpu - self._cpu)
        self._wall, self._cpu = wall, cpu


#: this process's clock (one per worker process; a forked child starts from the parent's totals, which a
#: snapshot difference cancels out)
clock = StageClock()
