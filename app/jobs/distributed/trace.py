"""A distributed job's Chrome trace (open it in Perfetto), from the node rows in PostgreSQL: one complete event
per node that ran (its last attempt, from claim to result), grouped by node kind, on lanes that never overlap,
so the lanes in use at a moment are the nodes running on all workers then."""

from __future__ import annotations

import heapq
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from app.db.repository import node_tasks as tasks_repo

MAX_EVENTS = 20_000


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def job_trace(session: Session, job_id: str, *, limit: int = MAX_EVENTS) -> dict[str, Any]:
    rows = tasks_repo.node_task_timeline(session, job_id=job_id, limit=limit)
    events: list[dict[str, Any]] = []
    if not rows:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = _aware(rows[0][3])
    pids: dict[str, int] = {}
    lanes: dict[int, list[tuple[float, int]]] = {}  # pid -> heap of (lane free at, lane)
    for node_id, kind, item_id, started, finished, status, attempts in rows:
        pid = pids.setdefault(kind, len(pids) + 1)
        start = (_aware(started) - t0).total_seconds() * 1e6
        end = (_aware(finished) - t0).total_seconds() * 1e6 if finished is not None else start
        heap = lanes.setdefault(pid, [])
        if heap and heap[0][0] <= start:
            _, lane = heapq.heappop(heap)
        else:
            lane = len(heap) + 1
        heapq.heappush(heap, (end, lane))
        events.append(
            {
                "name": node_id,
                "cat": "node" if status == "done" else "node,error",
                "ph": "X",
                "ts": round(start, 3),
                "dur": round(max(0.0, end - start), 3),
                "pid": pid,
                "tid": lane,
                "args": {"item_id": item_id, "status": status, "attempts": attempts},
            }
        )
    for kind, pid in pids.items():
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": f"{kind} nodes"}}
        )
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if len(rows) >= limit:
        trace["otherData"] = {"truncated": f"the first {limit} nodes of the job"}
    return trace
