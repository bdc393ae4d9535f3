"""Reporting side of the profiler: Chrome Trace Event JSON and run statistics, computed from a recording's
:class:`~app.pipeline.profiling.records.Snapshot`.

Layout of the trace (loads in Perfetto and chrome://tracing):

* pid 1 is the scheduler process (named ``process_name``) carrying the ``queue_depth`` counter;
* every endpoint alias (``"local"`` for plain python nodes) is its own process, pid 2, 3, ... in order of first use;
* every concurrent slot of an endpoint is a thread: a starting task takes the lowest free slot, so tasks on one
  thread never overlap.  ``tid = slot + 1`` because older Perfetto builds merge tid 0 into tid 1;
* waits that happen before their task owns a slot go to separate "wait lane" threads (tid >= 10001) so they
  cannot overlap a task slice either.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.pipeline.profiling.records import SCHEDULER_PID, WAIT_LANE_TID_BASE, Attempt, Snapshot

__all__ = [
    "DurationStats",
    "EndpointStatistics",
    "ProfileStatistics",
    "chrome_trace",
    "save_trace",
    "statistics",
]

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


@dataclass
class _Tally:
    """What the attempts add up to (one pass over them)."""

    per_endpoint: dict[str, EndpointStatistics]
    per_endpoint_intervals: dict[str, list[tuple[float, float]]]
    final_state: dict[str, str] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    task_time: float = 0.0
    attempts: int = 0


def statistics(snap: Snapshot) -> ProfileStatistics:
    """Task counts, durations, utilisation, bubbles, rate limits and waits of a recording."""
    wall = sum(e - s for s, e in snap.segments)
    tally = _tally_attempts(snap)
    per_ep = tally.per_endpoint
    _endpoint_utilisation(per_ep, tally.per_endpoint_intervals, wall)
    for _, ep, _ in snap.rate_limits:
        per_ep[ep.name].rate_limit_events += 1
    wait_total, wait_count = _tally_waits(snap, per_ep)
    bubble_time, bubble_count = _bubbles(_merge(tally.intervals), snap.segments, snap.min_bubble_s)
    counts = list(tally.final_state.values())
    global_util: float | None = None
    if snap.global_capacity and wall > 0:
        global_util = tally.task_time / (snap.global_capacity * wall)

    return ProfileStatistics(
        total_tasks=len(tally.final_state),
        completed=counts.count("completed"),
        failed=counts.count("failed"),
        retried=tally.attempts - len(tally.final_state),
        unfinished=counts.count("unfinished"),
        attempts=tally.attempts,
        wall_time_s=wall,
        task_duration_ms=DurationStats.from_seconds(tally.durations),
        queue_time_ms=DurationStats.from_seconds(tally.queue_times),
        endpoints=per_ep,
        max_concurrency=snap.max_running,
        global_capacity=snap.global_capacity,
        global_utilisation=global_util,
        bubble_time_s=bubble_time,
        bubble_count=bubble_count,
        bubble_fraction=bubble_time / wall if wall > 0 else 0.0,
        rate_limit_events=len(snap.rate_limits),
        wait_time_s=wait_total,
        wait_count=wait_count,
    )


def _tally_attempts(snap: Snapshot) -> _Tally:
    tally = _Tally(
        per_endpoint={
            name: EndpointStatistics(endpoint=name, capacity=ep.capacity, max_concurrency=ep.max_active)
            for name, ep in snap.endpoints.items()
        },
        per_endpoint_intervals={name: [] for name in snap.endpoints},
    )
    # Closed attempts come first in close order and open ones last, so the final write per task_id is its
    # latest attempt.
    for attempt, a_end, status in snap.attempts:
        tally.attempts += 1
        if status == "completed":
            state = "completed"
        elif status == "failed":
            state = "unfinished" if attempt.will_retry else "failed"
        else:
            state = "unfinished"
        tally.final_state[attempt.task_id] = state

        length = a_end - attempt.start
        tally.task_time += length
        tally.intervals.append((attempt.start, a_end))
        tally.per_endpoint_intervals[attempt.endpoint.name].append((attempt.start, a_end))
        if status in ("completed", "failed"):
            tally.durations.append(length)
        if attempt.queued_at is not None:
            tally.queue_times.append(max(0.0, attempt.start - attempt.queued_at))

        eps = tally.per_endpoint[attempt.endpoint.name]
        eps.tasks += 1
        eps.task_time_s += length
        if status == "completed":
            eps.completed += 1
        elif status == "failed":
            eps.failed += 1
    return tally


def _endpoint_utilisation(
    per_ep: dict[str, EndpointStatistics], intervals: dict[str, list[tuple[float, float]]], wall: float
) -> None:
    for name, eps in per_ep.items():
        eps.busy_time_s = _covered(_merge(intervals[name]))
        if wall > 0:
            if eps.capacity:
                eps.utilisation = eps.task_time_s / (eps.capacity * wall)
            else:
                eps.utilisation = eps.busy_time_s / wall


def _tally_waits(snap: Snapshot, per_ep: dict[str, EndpointStatistics]) -> tuple[float, int]:
    """Total wait time and count, also added to each endpoint's figures."""
    wait_total = 0.0
    wait_count = 0
    for wait, w_end in snap.waits:
        length = w_end - wait.start
        wait_total += length
        wait_count += 1
        eps = per_ep[wait.endpoint.name]
        eps.wait_time_s += length
        eps.wait_count += 1
    return wait_total, wait_count


def _bubbles(
    merged: list[tuple[float, float]], segments: list[tuple[float, float]], min_bubble_s: float
) -> tuple[float, int]:
    """Idle gaps (no task running) inside the profiled spans: total seconds and how many."""
    ends = [e for _, e in merged]
    total = 0.0
    count = 0

    def gap(length: float) -> None:
        nonlocal total, count
        if length > 0 and length >= min_bubble_s:
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


# --------------------------------------------------------------------------------------------------------------
# Chrome trace
# --------------------------------------------------------------------------------------------------------------


class _Trace:
    """Turns a snapshot's times (seconds) into trace microseconds and its user data into strict JSON."""

    def __init__(self, snap: Snapshot) -> None:
        self.t0 = snap.t0
        self.max_arg_chars = snap.max_arg_chars

    def us(self, t: float) -> float:
        return round((t - self.t0) * 1_000_000.0, 3)

    def span(self, start: float, end: float) -> tuple[float, float]:
        """``(ts, dur)`` of a slice."""
        ts = self.us(start)
        return ts, max(0.0, round(self.us(end) - ts, 3))

    def jsonable(self, value: Any, depth: int = 0) -> Any:
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
                return {str(k): self.jsonable(v, depth + 1) for k, v in value.items()}
            if isinstance(value, list | tuple | set | frozenset):
                return [self.jsonable(v, depth + 1) for v in value]
        return self.jsonable(repr(value), _MAX_ARG_DEPTH)


def chrome_trace(snap: Snapshot) -> dict[str, Any]:
    """The Chrome Trace Event JSON of a recording, with its statistics under ``otherData``."""
    trace = _Trace(snap)
    events: list[dict[str, Any]] = _metadata_events(snap)
    for attempt, a_end, status in snap.attempts:
        events.extend(_task_events(trace, attempt, a_end, status))
    events.extend(_wait_events(trace, snap))
    events.extend(_rate_limit_events(trace, snap))
    if snap.include_counters:
        events.extend(_counter_events(trace, snap))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": snap.process_name,
            "statistics": trace.jsonable(statistics(snap).to_dict()),
        },
    }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _metadata_events(snap: Snapshot) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    if snap.include_counters:
        events.append(_meta("process_name", SCHEDULER_PID, 1, {"name": snap.process_name}))
        events.append(_meta("process_sort_index", SCHEDULER_PID, 1, {"sort_index": 0}))
        events.append(_meta("thread_name", SCHEDULER_PID, 1, {"name": "scheduler"}))
        if snap.global_capacity is not None:
            labels = f"max_concurrent={snap.global_capacity}"
            events.append(_meta("process_labels", SCHEDULER_PID, 1, {"labels": labels}))
    for index, ep in enumerate(snap.endpoints.values(), start=1):
        events.append(_meta("process_name", ep.pid, 1, {"name": ep.name}))
        events.append(_meta("process_sort_index", ep.pid, 1, {"sort_index": index}))
        if ep.capacity is not None:
            events.append(_meta("process_labels", ep.pid, 1, {"labels": f"capacity={ep.capacity}"}))
        # Name at least slot 0 so counters / rate-limit marks on tid 1 sit on a labelled track.
        for slot in range(max(ep.slots.size, 1)):
            events.append(_meta("thread_name", ep.pid, slot + 1, {"name": f"slot {slot}"}))
            events.append(_meta("thread_sort_index", ep.pid, slot + 1, {"sort_index": slot}))
        for lane in range(ep.lanes.size):
            tid = WAIT_LANE_TID_BASE + lane + 1
            events.append(_meta("thread_name", ep.pid, tid, {"name": f"wait lane {lane}"}))
            events.append(_meta("thread_sort_index", ep.pid, tid, {"sort_index": tid}))
    return events


def _task_events(trace: _Trace, attempt: Attempt, a_end: float, status: str) -> list[dict[str, Any]]:
    """The slice of one attempt on its slot thread, and a ``task_failed`` mark at its end when it failed."""
    ep = attempt.endpoint
    tid = attempt.slot + 1
    ts, dur = trace.span(attempt.start, a_end)
    failed = status == "failed"
    task = {
        "name": attempt.name,
        "cat": "task,error" if failed else "task",
        "ph": "X",
        "ts": ts,
        "dur": dur,
        "pid": ep.pid,
        "tid": tid,
        "args": _task_args(trace, attempt, status),
    }
    if not failed:
        return [task]
    mark = {
        "name": "task_failed",
        "cat": "error",
        "ph": "i",
        "s": "t",
        "ts": trace.us(a_end),
        "pid": ep.pid,
        "tid": tid,
        "args": {
            "task_id": attempt.task_id,
            "name": attempt.name,
            "error": trace.jsonable(attempt.error),
            "will_retry": attempt.will_retry,
        },
    }
    return [task, mark]


def _task_args(trace: _Trace, attempt: Attempt, status: str) -> dict[str, Any]:
    args: dict[str, Any] = {
        "task_id": attempt.task_id,
        "status": status,
        "endpoint": attempt.endpoint.name,
        "slot": attempt.slot,
        "attempt": attempt.attempt,
        "retries": attempt.attempt - 1,
    }
    if attempt.queued_at is not None:
        args["queued_ms"] = round((attempt.start - attempt.queued_at) * 1000.0, 3)
    if status == "failed":
        args["error"] = trace.jsonable(attempt.error)
        args["will_retry"] = attempt.will_retry
    if attempt.args is not None:
        args["args"] = trace.jsonable(attempt.args)
    if attempt.result is not None:
        args["result"] = trace.jsonable(attempt.result)
    return args


def _wait_events(trace: _Trace, snap: Snapshot) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for wait, w_end in snap.waits:
        ts, dur = trace.span(wait.start, w_end)
        events.append(
            {
                "name": f"wait:{wait.reason}",
                "cat": "wait",
                "ph": "X",
                "ts": ts,
                "dur": dur,
                "pid": wait.endpoint.pid,
                "tid": wait.tid,
                "args": {"task_id": wait.task_id, "reason": wait.reason},
            }
        )
    return events


def _rate_limit_events(trace: _Trace, snap: Snapshot) -> list[dict[str, Any]]:
    return [
        {
            "name": "rate_limit",
            "cat": "rate_limit",
            "ph": "i",
            "s": "p",
            "ts": trace.us(t),
            "pid": ep.pid,
            "tid": 1,
            "args": {"endpoint": ep.name, "retry_after_s": trace.jsonable(retry_after)},
        }
        for t, ep, retry_after in snap.rate_limits
    ]


def _counter_events(trace: _Trace, snap: Snapshot) -> list[dict[str, Any]]:
    """The scheduler's ``queue_depth`` counter, then each endpoint's ``active_tasks`` counter."""
    events = [
        _counter("queue_depth", trace.us(t), SCHEDULER_PID, {"ready": ready, "running": running})
        for t, ready, running in snap.queue_samples
    ]
    events.extend(
        _counter("active_tasks", trace.us(t), ep.pid, {"active": active}) for t, ep, active in snap.active_samples
    )
    return events


def _counter(name: str, ts: float, pid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": "counter", "ph": "C", "ts": ts, "pid": pid, "tid": 1, "args": args}


def save_trace(payload: dict[str, Any], path: str | Path) -> Path:
    """Write a Chrome trace to ``path`` (its folder created), so that a crash never leaves half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so a crash mid-write never leaves a truncated (unloadable) trace behind.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(payload, fh, allow_nan=False, separators=(",", ":"))
    os.replace(tmp, target)
    return target
