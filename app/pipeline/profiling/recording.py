"""Recording side of the Chrome Trace Event profiler for pipeline runs.

The scheduler calls the ``task_*`` / ``wait_*`` / ``rate_limit_hit`` / ``queue_depth`` hooks from its event
loop thread.  Hooks only record timestamps into small objects and lists (:mod:`.records`); all formatting
(Chrome Trace JSON, statistics) happens later in :mod:`.reporting`, reached through
:meth:`TraceProfiler.to_chrome_trace` / :meth:`TraceProfiler.get_statistics`, so a run with tens of thousands
of tasks pays a few microseconds per hook.

Every endpoint alias (``"local"`` for plain python nodes) is its own trace process, pid 2, 3, ... in order of
first use; a starting task takes the lowest free slot of its endpoint (a trace thread, ``tid = slot + 1``), so
tasks on one thread never overlap; waits that happen before their task owns a slot take a "wait lane" thread
(tid >= 10001) so they cannot overlap a task slice either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from app.pipeline.profiling.records import (
    SCHEDULER_PID,
    WAIT_LANE_TID_BASE,
    Attempt,
    Endpoint,
    Snapshot,
    Wait,
)
from app.pipeline.profiling.reporting import ProfileStatistics, chrome_trace, save_trace, statistics

__all__ = ["TraceProfiler"]


class TraceProfiler:
    """Records scheduler events; exports them as a Chrome trace plus :class:`ProfileStatistics` (see
    :mod:`app.pipeline.profiling.reporting`).

    ``start()`` opens a profiled span and ``stop()`` closes it; a later ``start()`` opens another span (e.g. one
    per ``run()``) on the same timeline, and bubble/wall time only count time inside spans.  A hook called before
    the first ``start()`` starts the profiler implicitly; hooks called while stopped are ignored, because the
    tasks they refer to were already closed as ``"unfinished"``.

    Keyword-only extras: ``clock`` (seconds, defaults to ``time.perf_counter``; tests inject a fake one),
    ``max_arg_chars`` (strings in exported args are cut to this length so prompts do not bloat the trace;
    ``None`` keeps them whole) and ``min_bubble_s`` (idle gaps shorter than this are not bubbles; ``0`` counts
    every gap).
    """

    def __init__(
        self,
        include_counters: bool = True,
        include_args: bool = True,
        process_name: str = "inf-engine",
        *,
        clock: Callable[[], float] | None = None,
        max_arg_chars: int | None = 1000,
        min_bubble_s: float = 0.0,
    ) -> None:
        self.include_counters = include_counters
        self.include_args = include_args
        self.process_name = process_name
        self.max_arg_chars = max_arg_chars
        self.min_bubble_s = min_bubble_s
        self._clock: Callable[[], float] = clock if clock is not None else time.perf_counter

        self._t0: float | None = None
        self._running = False
        # Profiled spans as [start, end]; end of the open span is filled in by stop().
        self._segments: list[list[float]] = []

        self._endpoints: dict[str, Endpoint] = {}
        self._global_capacity: int | None = None

        self._open: dict[str, Attempt] = {}
        self._closed: list[Attempt] = []
        self._attempt_counts: dict[str, int] = {}
        self._queued: dict[str, float] = {}
        self._n_running = 0
        self._max_running = 0

        self._open_waits: dict[str, Wait] = {}
        self._closed_waits: list[Wait] = []

        self._rate_limits: list[tuple[float, Endpoint, float | None]] = []
        self._queue_samples: list[tuple[float, int, int]] = []
        self._active_samples: list[tuple[float, Endpoint, int]] = []

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._running:
            return
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        self._segments.append([now, now])
        self._running = True

    def stop(self) -> None:
        if not self._running:
            return
        now = self._clock()
        open_attempts = list(self._open.values())
        self._open.clear()
        for attempt in open_attempts:
            self._close(attempt, now, "unfinished")
        for wait in list(self._open_waits.values()):
            self._close_wait(wait, now)
        self._queued.clear()
        self._segments[-1][1] = max(now, self._segments[-1][0])
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    # ---------------------------------------------------------------- configuration (recorded even while stopped)

    def set_capacity(self, endpoint: str, capacity: int | None) -> None:
        self._endpoint(endpoint).capacity = capacity

    def set_global_capacity(self, capacity: int) -> None:
        self._global_capacity = capacity

    # ---------------------------------------------------------------- hooks

    def task_queued(self, task_id: str) -> None:
        now = self._now()
        if now is None:
            return
        self._queued[task_id] = now

    def task_started(
        self, task_id: str, name: str, endpoint: str, args: dict[str, Any] | None = None
    ) -> None:
        now = self._now()
        if now is None:
            return
        previous = self._open.pop(task_id, None)
        if previous is not None:
            # Started again without a finish/fail: close the old attempt so its slot is not leaked.
            self._close(previous, now, "unfinished")
        ep = self._endpoint(endpoint)
        attempt_no = self._attempt_counts.get(task_id, 0) + 1
        self._attempt_counts[task_id] = attempt_no
        # Shallow copy: the caller may mutate its dict after the hook returns.
        kept_args = dict(args) if (args and self.include_args) else None
        attempt = Attempt(
            task_id, name, ep, ep.slots.acquire(), now, attempt_no, self._queued.pop(task_id, None), kept_args
        )
        self._open[task_id] = attempt
        ep.active += 1
        if ep.active > ep.max_active:
            ep.max_active = ep.active
        self._n_running += 1
        if self._n_running > self._max_running:
            self._max_running = self._n_running
        if self.include_counters:
            self._active_samples.append((now, ep, ep.active))

    def task_finished(self, task_id: str, result: dict[str, Any] | None = None) -> None:
        now = self._now()
        if now is None:
            return
        attempt = self._open.pop(task_id, None)
        if attempt is None:
            return  # unknown or already closed: hooks must never raise inside the scheduler
        if result and self.include_args:
            attempt.result = dict(result)
        self._close(attempt, now, "completed")

    def task_failed(self, task_id: str, error: str, will_retry: bool = False) -> None:
        now = self._now()
        if now is None:
            return
        attempt = self._open.pop(task_id, None)
        if attempt is None:
            return
        attempt.error = error
        attempt.will_retry = will_retry
        self._close(attempt, now, "failed")

    def rate_limit_hit(self, endpoint: str, retry_after: float | None = None) -> None:
        now = self._now()
        if now is None:
            return
        self._rate_limits.append((now, self._endpoint(endpoint), retry_after))

    def wait_started(self, task_id: str, endpoint: str, reason: str = "rate_limit") -> None:
        now = self._now()
        if now is None:
            return
        previous = self._open_waits.get(task_id)
        if previous is not None:
            self._close_wait(previous, now)
        ep = self._endpoint(endpoint)
        attempt = self._open.get(task_id)
        if attempt is not None and attempt.endpoint is ep:
            # Nested inside the task's own slice on its slot thread.
            wait = Wait(task_id, ep, reason, attempt.slot + 1, False, now)
        else:
            # No slot yet: a dedicated lane keeps concurrent pre-start waits from overlapping.
            wait = Wait(task_id, ep, reason, WAIT_LANE_TID_BASE + ep.lanes.acquire() + 1, True, now)
        self._open_waits[task_id] = wait

    def wait_finished(self, task_id: str) -> None:
        now = self._now()
        if now is None:
            return
        wait = self._open_waits.get(task_id)
        if wait is not None:
            self._close_wait(wait, now)

    def queue_depth(self, ready: int, running: int) -> None:
        if not self.include_counters:
            return
        now = self._now()
        if now is None:
            return
        self._queue_samples.append((now, ready, running))

    # ---------------------------------------------------------------- internals

    def _now(self) -> float | None:
        """Current time, or None when stopped (the event is dropped)."""
        if not self._running:
            if self._t0 is not None:
                return None
            self.start()
        return self._clock()

    def _endpoint(self, name: str) -> Endpoint:
        ep = self._endpoints.get(name)
        if ep is None:
            ep = Endpoint(name, SCHEDULER_PID + 1 + len(self._endpoints))
            self._endpoints[name] = ep
        return ep

    def _close(self, attempt: Attempt, now: float, status: str) -> None:
        # Clamp so an odd clock can never produce a negative duration.
        attempt.end = now if now >= attempt.start else attempt.start
        attempt.status = status
        self._closed.append(attempt)
        ep = attempt.endpoint
        ep.slots.release(attempt.slot)
        ep.active -= 1
        self._n_running -= 1
        if self.include_counters:
            self._active_samples.append((attempt.end, ep, ep.active))
        wait = self._open_waits.get(attempt.task_id)
        if wait is not None and not wait.on_lane:
            # A wait on the slot thread must end inside the task slice to nest properly.
            self._close_wait(wait, attempt.end)

    def _close_wait(self, wait: Wait, now: float) -> None:
        wait.end = now if now >= wait.start else wait.start
        del self._open_waits[wait.task_id]
        self._closed_waits.append(wait)
        if wait.on_lane:
            wait.endpoint.lanes.release(wait.tid - WAIT_LANE_TID_BASE - 1)

    def _snapshot_end(self) -> float:
        """End of the profile: stop time, or now while still running (open items are cut there virtually)."""
        if self._running:
            return self._clock()
        if self._segments:
            return self._segments[-1][1]
        return 0.0

    def _segment_bounds(self, end: float) -> list[tuple[float, float]]:
        bounds = [(s, e) for s, e in self._segments]
        if self._running and bounds:
            bounds[-1] = (bounds[-1][0], max(end, bounds[-1][0]))
        return bounds

    def _attempts(self, end: float) -> Iterator[tuple[Attempt, float, str]]:
        """Every attempt as (record, end, status); open ones are reported as still running up to ``end``."""
        for attempt in self._closed:
            yield attempt, attempt.end, attempt.status
        for attempt in self._open.values():
            yield attempt, max(end, attempt.start), "running"

    def _waits(self, end: float) -> Iterator[tuple[Wait, float]]:
        for wait in self._closed_waits:
            yield wait, wait.end
        for wait in self._open_waits.values():
            yield wait, max(end, wait.start)

    def snapshot(self) -> Snapshot:
        """The recording as of now (or as of stop()): what reports are computed from."""
        end = self._snapshot_end()
        return Snapshot(
            t0=self._t0 if self._t0 is not None else end,
            end=end,
            segments=self._segment_bounds(end),
            attempts=list(self._attempts(end)),
            waits=list(self._waits(end)),
            endpoints=dict(self._endpoints),
            rate_limits=list(self._rate_limits),
            queue_samples=list(self._queue_samples),
            active_samples=list(self._active_samples),
            global_capacity=self._global_capacity,
            max_running=self._max_running,
            process_name=self.process_name,
            include_counters=self.include_counters,
            max_arg_chars=self.max_arg_chars,
            min_bubble_s=self.min_bubble_s,
        )

    # ---------------------------------------------------------------- export

    def to_chrome_trace(self) -> dict[str, Any]:
        return chrome_trace(self.snapshot())

    def save(self, path: str | Path) -> Path:
        return save_trace(self.to_chrome_trace(), path)

    def get_statistics(self) -> ProfileStatistics:
        return statistics(self.snapshot())
