"""Chrome Trace Event profiler for pipeline runs.

The scheduler calls the ``task_*`` / ``wait_*`` / ``rate_limit_hit`` / ``queue_depth`` hooks from its event
loop thread.  Hooks only record timestamps into small objects and lists; all formatting (Chrome Trace JSON,
statistics) happens later in :meth:`TraceProfiler.to_chrome_trace` / :meth:`TraceProfiler.get_statistics`, so
a run with tens of thousands of tasks pays a few microseconds per hook.

Layout of the trace (loads in Perfetto and chrome://tracing):

* pid 1 is the scheduler process (named ``process_name``) carrying the ``queue_depth`` counter;
* every endpoint alias (``"local"`` for plain python nodes) is its own process, pid 2, 3, ... in order of first use;
* every concurrent slot of an endpoint is a thread: a starting task takes the lowest free slot, so tasks on one
  thread never overlap.  ``tid = slot + 1`` because older Perfetto builds merge tid 0 into tid 1;
* waits that happen before their task owns a slot go to separate "wait lane" threads (tid >= 10001) so they
  cannot overlap a task slice either.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DurationStats",
    "EndpointStatistics",
    "ProfileStatistics",
    "TraceProfiler",
]

SCHEDULER_PID = 1
# Wait lanes get their own tid range so they can never collide with a slot thread of the same process.
WAIT_LANE_TID_BASE = 10_000
# Object nesting deeper than this is rendered with repr(); protects against cyclic user args.
_MAX_ARG_DEPTH = 8


# --------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------


@dataclass
class DurationStats:
    """Summary of a set of durations, in milliseconds (all zero when ``count == 0``)."""

    count: int = 0
    min_ms: float = 0.0
    avg_ms: float = 0.0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def from_seconds(cls, values: list[float]) -> DurationStats:
        if not values:
            return cls()
        ms = sorted(v * 1000.0 for v in values)
        return cls(
            count=len(ms),
            min_ms=ms[0],
            avg_ms=sum(ms) / len(ms),
            p50_ms=_percentile(ms, 50.0),
            p95_ms=_percentile(ms, 95.0),
            max_ms=ms[-1],
        )


@dataclass
class EndpointStatistics:
    """Per-endpoint figures.  ``tasks``/``completed``/``failed`` count attempts on this endpoint."""

    endpoint: str
    tasks: int = 0
    completed: int = 0
    failed: int = 0
    capacity: int | None = None
    # Sum of the attempts' durations (seconds).
    task_time_s: float = 0.0
    # Time during which at least one attempt of this endpoint was running (seconds).
    busy_time_s: float = 0.0
    # task_time / (capacity * wall) when the capacity is known, else busy_time / wall.
    utilisation: float = 0.0
    max_concurrency: int = 0
    rate_limit_events: int = 0
    wait_time_s: float = 0.0
    wait_count: int = 0


@dataclass
class ProfileStatistics:
    """Summary of a profiled span.

    Task counts are per distinct ``task_id`` by the state of its last attempt: ``completed``, ``failed`` (failed
    with no retry pending) or ``unfinished`` (still running at stop, or waiting for a retry that never started).
    ``retried`` counts attempts after the first one; ``attempts`` counts every start.
    """

    total_tasks: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    unfinished: int = 0
    attempts: int = 0
    wall_time_s: float = 0.0
    # Durations of attempts that ended (completed or failed); attempts cut off by stop() are excluded
    # because their duration is not a real task duration.
    task_duration_ms: DurationStats = field(default_factory=DurationStats)
    # Time from task_queued to task_started, for attempts that reported being queued.
    queue_time_ms: DurationStats = field(default_factory=DurationStats)
    endpoints: dict[str, EndpointStatistics] = field(default_factory=dict)
    max_concurrency: int = 0
    global_capacity: int | None = None
    # Sum of all attempt durations / (global capacity * wall); None when the capacity is unknown.
    global_utilisation: float | None = None
    bubble_time_s: float = 0.0
    bubble_count: int = 0
    bubble_fraction: float = 0.0
    rate_limit_events: int = 0
    wait_time_s: float = 0.0
    wait_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(sorted_values: list[float], pct: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an ascending, non-empty list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (len(sorted_values) - 1) * pct / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of closed intervals as a sorted list of disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _covered(merged: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged)


# --------------------------------------------------------------------------------------------------------------
# Internal records (mutable, __slots__ to keep tens of thousands of them cheap)
# --------------------------------------------------------------------------------------------------------------


class _SlotPool:
    """Hands out the lowest free slot number; freed numbers are reused before new ones are minted."""

    __slots__ = ("_free", "size")

    def __init__(self) -> None:
        self._free: list[int] = []
        self.size = 0  # slots ever minted; every freed slot is < size, so the heap minimum is the lowest free

    def acquire(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        slot = self.size
        self.size += 1
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


class _Endpoint:
    __slots__ = ("active", "capacity", "lanes", "max_active", "name", "pid", "slots")

    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.slots = _SlotPool()
        self.lanes = _SlotPool()
        self.capacity: int | None = None
        self.active = 0
        self.max_active = 0


class _Attempt:
    __slots__ = (
        "args",
        "attempt",
        "end",
        "endpoint",
        "error",
        "name",
        "queued_at",
        "result",
        "slot",
        "start",
        "status",
        "task_id",
        "will_retry",
    )

    def __init__(
        self,
        task_id: str,
        name: str,
        endpoint: _Endpoint,
        slot: int,
        start: float,
        attempt: int,
        queued_at: float | None,
        args: dict[str, Any] | None,
    ) -> None:
        self.task_id = task_id
        self.name = name
        self.endpoint = endpoint
        self.slot = slot
        self.start = start
        self.attempt = attempt
        self.queued_at = queued_at
        self.args = args
        self.end = start
        self.status = "running"
        self.error: str | None = None
        self.will_retry = False
        self.result: dict[str, Any] | None = None


class _Wait:
    __slots__ = ("end", "endpoint", "on_lane", "reason", "start", "task_id", "tid")

    def __init__(
        self, task_id: str, endpoint: _Endpoint, reason: str, tid: int, on_lane: bool, start: float
    ) -> None:
        self.task_id = task_id
        self.endpoint = endpoint
        self.reason = reason
        self.tid = tid
        self.on_lane = on_lane
        self.start = start
        self.end = start


# --------------------------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------------------------


class TraceProfiler:
    """Records scheduler events and exports them as a Chrome trace plus :class:`ProfileStatistics`.

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

        self._endpoints: dict[str, _Endpoint] = {}
        self._global_capacity: int | None = None

        self._open: dict[str, _Attempt] = {}
        self._closed: list[_Attempt] = []
        self._attempt_counts: dict[str, int] = {}
        self._queued: dict[str, float] = {}
        self._n_running = 0
        self._max_running = 0

        self._open_waits: dict[str, _Wait] = {}
        self._closed_waits: list[_Wait] = []

        self._rate_limits: list[tuple[float, _Endpoint, float | None]] = []
        self._queue_samples: list[tuple[float, int, int]] = []
        self._active_samples: list[tuple[float, _Endpoint, int]] = []

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
        attempt = _Attempt(
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
            wait = _Wait(task_id, ep, reason, attempt.slot + 1, False, now)
        else:
            # No slot yet: a dedicated lane keeps concurrent pre-start waits from overlapping.
            wait = _Wait(task_id, ep, reason, WAIT_LANE_TID_BASE + ep.lanes.acquire() + 1, True, now)
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

    def _endpoint(self, name: str) -> _Endpoint:
        ep = self._endpoints.get(name)
        if ep is None:
            ep = _Endpoint(name, SCHEDULER_PID + 1 + len(self._endpoints))
            self._endpoints[name] = ep
        return ep

    def _close(self, attempt: _Attempt, now: float, status: str) -> None:
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

    def _close_wait(self, wait: _Wait, now: float) -> None:
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

    def _attempts(self, end: float) -> Iterator[tuple[_Attempt, float, str]]:
        """Every attempt as (record, end, status); open ones are reported as still running up to ``end``."""
        for attempt in self._closed:
            yield attempt, attempt.end, attempt.status
        for attempt in self._open.values():
            yield attempt, max(end, attempt.start), "running"

    def _waits(self, end: float) -> Iterator[tuple[_Wait, float]]:
        for wait in self._closed_waits:
            yield wait, wait.end
        for wait in self._open_waits.values():
            yield wait, max(end, wait.start)

    def _jsonable(self, value: Any, depth: int = 0) -> Any:
        """Coerce user data into strict JSON (no NaN, str keys, cut strings) so every viewer can load it."""
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, str):
            limit = self.max_arg_chars
            if limit is not None and len(value) > limit:
                return value[:limit] + f"…(+{len(value) - limit} chars)"
            return value
        if depth < _MAX_ARG_DEPTH:
            if isinstance(value, dict):
                return {str(k): self._jsonable(v, depth + 1) for k, v in value.items()}
            if isinstance(value, list | tuple | set | frozenset):
                return [self._jsonable(v, depth + 1) for v in value]
        return self._jsonable(repr(value), _MAX_ARG_DEPTH)

    # ---------------------------------------------------------------- export

    def to_chrome_trace(self) -> dict[str, Any]:
        end = self._snapshot_end()
        t0 = self._t0 if self._t0 is not None else end

        def us(t: float) -> float:
            return round((t - t0) * 1_000_000.0, 3)

        events: list[dict[str, Any]] = []
        events.extend(self._metadata_events())

        for attempt, a_end, status in self._attempts(end):
            ep = attempt.endpoint
            tid = attempt.slot + 1
            ts = us(attempt.start)
            dur = max(0.0, round(us(a_end) - ts, 3))
            args: dict[str, Any] = {
                "task_id": attempt.task_id,
                "status": status,
                "endpoint": ep.name,
                "slot": attempt.slot,
                "attempt": attempt.attempt,
                "retries": attempt.attempt - 1,
            }
            if attempt.queued_at is not None:
                args["queued_ms"] = round((attempt.start - attempt.queued_at) * 1000.0, 3)
            failed = status == "failed"
            if failed:
                args["error"] = self._jsonable(attempt.error)
                args["will_retry"] = attempt.will_retry
            if attempt.args is not None:
                args["args"] = self._jsonable(attempt.args)
            if attempt.result is not None:
                args["result"] = self._jsonable(attempt.result)
            events.append(
                {
                    "name": attempt.name,
                    "cat": "task,error" if failed else "task",
                    "ph": "X",
                    "ts": ts,
                    "dur": dur,
                    "pid": ep.pid,
                    "tid": tid,
                    "args": args,
                }
            )
            if failed:
                events.append(
                    {
                        "name": "task_failed",
                        "cat": "error",
                        "ph": "i",
                        "s": "t",
                        "ts": us(a_end),
                        "pid": ep.pid,
                        "tid": tid,
                        "args": {
                            "task_id": attempt.task_id,
                            "name": attempt.name,
                            "error": self._jsonable(attempt.error),
                            "will_retry": attempt.will_retry,
                        },
                    }
                )

        for wait, w_end in self._waits(end):
            ts = us(wait.start)
            events.append(
                {
                    "name": f"wait:{wait.reason}",
                    "cat": "wait",
                    "ph": "X",
                    "ts": ts,
                    "dur": max(0.0, round(us(w_end) - ts, 3)),
                    "pid": wait.endpoint.pid,
                    "tid": wait.tid,
                    "args": {"task_id": wait.task_id, "reason": wait.reason},
                }
            )

        for t, ep, retry_after in self._rate_limits:
            events.append(
                {
                    "name": "rate_limit",
                    "cat": "rate_limit",
                    "ph": "i",
                    "s": "p",
                    "ts": us(t),
                    "pid": ep.pid,
                    "tid": 1,
                    "args": {"endpoint": ep.name, "retry_after_s": self._jsonable(retry_after)},
                }
            )

        if self.include_counters:
            for t, ready, running in self._queue_samples:
                events.append(
                    {
                        "name": "queue_depth",
                        "cat": "counter",
                        "ph": "C",
                        "ts": us(t),
                        "pid": SCHEDULER_PID,
                        "tid": 1,
                        "args": {"ready": ready, "running": running},
                    }
                )
            for t, ep, active in self._active_samples:
                events.append(
                    {
                        "name": "active_tasks",
                        "cat": "counter",
                        "ph": "C",
                        "ts": us(t),
                        "pid": ep.pid,
                        "tid": 1,
                        "args": {"active": active},
                    }
                )

        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": self.process_name,
                "statistics": self._jsonable(self._statistics(end).to_dict()),
            },
        }

    def _metadata_events(self) -> list[dict[str, Any]]:
        def meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
            return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}

        events: list[dict[str, Any]] = []
        if self.include_counters:
            events.append(meta("process_name", SCHEDULER_PID, 1, {"name": self.process_name}))
            events.append(meta("process_sort_index", SCHEDULER_PID, 1, {"sort_index": 0}))
            events.append(meta("thread_name", SCHEDULER_PID, 1, {"name": "scheduler"}))
            if self._global_capacity is not None:
                labels = f"max_concurrent={self._global_capacity}"
                events.append(meta("process_labels", SCHEDULER_PID, 1, {"labels": labels}))
        for index, ep in enumerate(self._endpoints.values(), start=1):
            events.append(meta("process_name", ep.pid, 1, {"name": ep.name}))
            events.append(meta("process_sort_index", ep.pid, 1, {"sort_index": index}))
            if ep.capacity is not None:
                events.append(meta("process_labels", ep.pid, 1, {"labels": f"capacity={ep.capacity}"}))
            # Name at least slot 0 so counters / rate-limit marks on tid 1 sit on a labelled track.
            for slot in range(max(ep.slots.size, 1)):
                events.append(meta("thread_name", ep.pid, slot + 1, {"name": f"slot {slot}"}))
                events.append(meta("thread_sort_index", ep.pid, slot + 1, {"sort_index": slot}))
            for lane in range(ep.lanes.size):
                tid = WAIT_LANE_TID_BASE + lane + 1
                events.append(meta("thread_name", ep.pid, tid, {"name": f"wait lane {lane}"}))
                events.append(meta("thread_sort_index", ep.pid, tid, {"sort_index": tid}))
        return events

    def save(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = self.to_chrome_trace()
        # Write-then-rename so a crash mid-write never leaves a truncated (unloadable) trace behind.
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            json.dump(payload, fh, allow_nan=False, separators=(",", ":"))
        os.replace(tmp, target)
        return target

    # ---------------------------------------------------------------- statistics

    def get_statistics(self) -> ProfileStatistics:
        return self._statistics(self._snapshot_end())

    def _statistics(self, end: float) -> ProfileStatistics:
        segments = self._segment_bounds(end)
        wall = sum(e - s for s, e in segments)

        final_state: dict[str, str] = {}
        durations: list[float] = []
        queue_times: list[float] = []
        all_intervals: list[tuple[float, float]] = []
        per_ep_intervals: dict[str, list[tuple[float, float]]] = {name: [] for name in self._endpoints}
        per_ep: dict[str, EndpointStatistics] = {
            name: EndpointStatistics(endpoint=name, capacity=ep.capacity, max_concurrency=ep.max_active)
            for name, ep in self._endpoints.items()
        }
        task_time_total = 0.0
        attempts = 0

        # Closed attempts come first in close order and open ones last, so the final write per task_id is its
        # latest attempt.
        for attempt, a_end, status in self._attempts(end):
            attempts += 1
            if status == "completed":
                state = "completed"
            elif status == "failed":
                state = "unfinished" if attempt.will_retry else "failed"
            else:
                state = "unfinished"
            final_state[attempt.task_id] = state

            length = a_end - attempt.start
            task_time_total += length
            all_intervals.append((attempt.start, a_end))
            per_ep_intervals[attempt.endpoint.name].append((attempt.start, a_end))
            if status in ("completed", "failed"):
                durations.append(length)
            if attempt.queued_at is not None:
                queue_times.append(max(0.0, attempt.start - attempt.queued_at))

            eps = per_ep[attempt.endpoint.name]
            eps.tasks += 1
            eps.task_time_s += length
            if status == "completed":
                eps.completed += 1
            elif status == "failed":
                eps.failed += 1

        for name, eps in per_ep.items():
            eps.busy_time_s = _covered(_merge(per_ep_intervals[name]))
            if wall > 0:
                if eps.capacity:
                    eps.utilisation = eps.task_time_s / (eps.capacity * wall)
                else:
                    eps.utilisation = eps.busy_time_s / wall

        for _, ep, _ in self._rate_limits:
            per_ep[ep.name].rate_limit_events += 1

        wait_total = 0.0
        wait_count = 0
        for wait, w_end in self._waits(end):
            length = w_end - wait.start
            wait_total += length
            wait_count += 1
            eps = per_ep[wait.endpoint.name]
            eps.wait_time_s += length
            eps.wait_count += 1

        bubble_time, bubble_count = self._bubbles(_merge(all_intervals), segments)
        counts = list(final_state.values())
        global_util: float | None = None
        if self._global_capacity and wall > 0:
            global_util = task_time_total / (self._global_capacity * wall)

        return ProfileStatistics(
            total_tasks=len(final_state),
            completed=counts.count("completed"),
            failed=counts.count("failed"),
            retried=attempts - len(final_state),
            unfinished=counts.count("unfinished"),
            attempts=attempts,
            wall_time_s=wall,
            task_duration_ms=DurationStats.from_seconds(durations),
            queue_time_ms=DurationStats.from_seconds(queue_times),
            endpoints=per_ep,
            max_concurrency=self._max_running,
            global_capacity=self._global_capacity,
            global_utilisation=global_util,
            bubble_time_s=bubble_time,
            bubble_count=bubble_count,
            bubble_fraction=bubble_time / wall if wall > 0 else 0.0,
            rate_limit_events=len(self._rate_limits),
            wait_time_s=wait_total,
            wait_count=wait_count,
        )

    def _bubbles(
        self, merged: list[tuple[float, float]], segments: list[tuple[float, float]]
    ) -> tuple[float, int]:
        """Idle gaps (no task running) inside the profiled spans: total seconds and how many."""
        ends = [e for _, e in merged]
        total = 0.0
        count = 0

        def gap(length: float) -> None:
            nonlocal total, count
            if length > 0 and length >= self.min_bubble_s:
                total += length
                count += 1

        for seg_start, seg_end in segments:
            cursor = seg_start
            # First busy interval that ends after the segment starts.
            i = bisect_right(ends, seg_start)
            while i < len(merged) and merged[i][0] < seg_end:
                start, stop = merged[i]
                gap(min(start, seg_end) - cursor)
                cursor = max(cursor, min(stop, seg_end))
                i += 1
            gap(seg_end - cursor)
        return total, count
