"""What the profiler records, shared by recording (which fills it in) and reporting (which reads it).

The records are mutable and use ``__slots__`` to keep tens of thousands of them cheap. ``Snapshot`` is the
recording as of one moment: everything a report needs, with open attempts and waits cut at its ``end``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

SCHEDULER_PID = 1
# Wait lanes get their own tid range so they can never collide with a slot thread of the same process.
WAIT_LANE_TID_BASE = 10_000


class SlotPool:
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


class Endpoint:
    __slots__ = ("active", "capacity", "lanes", "max_active", "name", "pid", "slots")

    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.slots = SlotPool()
        self.lanes = SlotPool()
        self.capacity: int | None = None
        self.active = 0
        self.max_active = 0


class Attempt:
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
        endpoint: Endpoint,
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


class Wait:
    __slots__ = ("end", "endpoint", "on_lane", "reason", "start", "task_id", "tid")

    def __init__(
        self, task_id: str, endpoint: Endpoint, reason: str, tid: int, on_lane: bool, start: float
    ) -> None:
        self.task_id = task_id
        self.endpoint = endpoint
        self.reason = reason
        self.tid = tid
        self.on_lane = on_lane
        self.start = start
        self.end = start


@dataclass
class Snapshot:
    """The recording as of ``end``: what the Chrome trace and the statistics are computed from."""

    #: time zero of the trace (the first start; ``end`` when the profiler never started)
    t0: float
    end: float
    #: the profiled spans, the open one cut at ``end``
    segments: list[tuple[float, float]]
    #: every attempt as (record, end, status), closed ones first in close order; open ones are "running"
    attempts: list[tuple[Attempt, float, str]]
    #: every wait as (record, end)
    waits: list[tuple[Wait, float]]
    endpoints: dict[str, Endpoint]
    rate_limits: list[tuple[float, Endpoint, float | None]]
    queue_samples: list[tuple[float, int, int]]
    active_samples: list[tuple[float, Endpoint, int]]
    global_capacity: int | None
    max_running: int
    process_name: str
    include_counters: bool
    max_arg_chars: int | None
    min_bubble_s: float
