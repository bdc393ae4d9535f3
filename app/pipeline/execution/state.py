"""ExecutionState: which nodes of one traced graph are ready, running, done, failed or cancelled."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from app.pipeline.graph import InferenceGraph, InputNode
from app.pipeline.values import Value

_creation = itertools.count()


class TaskStatus(str, Enum):
    PENDING = "pending"
    BLOCKED = "blocked"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(order=True)
class Task:
    """A runnable node. Tasks order by lower ``priority`` first, then creation time."""

    priority: int
    created: int = field(default_factory=lambda: next(_creation))
    node_id: str = field(default="", compare=False)
    retry_count: int = field(default=0, compare=False)
    rate_limit_count: int = field(default=0, compare=False)


@dataclass
class TaskResult:
    node_id: str
    value: Value
    duration_ms: float = 0.0
    retry_count: int = 0


class ExecutionState:
    """Tracks one graph run. ``preloaded`` maps node ids to Values already known (checkpoints): those nodes are
    complete from the start and never run."""

    def __init__(
        self,
        graph: InferenceGraph,
        execution_id: str | None = None,
        preloaded: dict[str, Value] | None = None,
    ) -> None:
        self.graph = graph
        self.execution_id = execution_id
        self.status: dict[str, TaskStatus] = {}
        self.results: dict[str, TaskResult] = {}
        self.errors: dict[str, BaseException] = {}
        self.dependents = graph.dependents()
        self.waiting: dict[str, int] = {}
        self._ready: list[Task] = []
        self.in_progress: dict[str, Task] = {}
        self.skipped: set[str] = set()
        preloaded = preloaded or {}
        for node_id in graph.topological_order():
            node = graph.nodes[node_id]
            if isinstance(node.module, InputNode):
                value = node.module.value
                assert value is not None, f"input node {node_id} has no value"
                self._complete_now(node_id, Value(value.kind, value.payload, node_id, dict(value.meta)))
            elif node_id in preloaded:
                self._complete_now(node_id, preloaded[node_id])
                self.skipped.add(node_id)
            else:
                missing = sum(1 for d in node.dependencies if self.status.get(d) is not TaskStatus.COMPLETED)
                self.waiting[node_id] = missing
                if missing:
                    self.status[node_id] = TaskStatus.BLOCKED
                else:
                    self._make_ready(node_id)

    def _complete_now(self, node_id: str, value: Value) -> None:
        self.status[node_id] = TaskStatus.COMPLETED
        self.results[node_id] = TaskResult(node_id, value)

    def _make_ready(self, node_id: str, retry_count: int = 0, rate_limit_count: int = 0) -> Task:
        self.status[node_id] = TaskStatus.PENDING
        task = Task(self.graph.nodes[node_id].priority, node_id=node_id, retry_count=retry_count,
                    rate_limit_count=rate_limit_count)
        heapq.heappush(self._ready, task)
        return task

    # -- the queue ------------------------------------------------------------------------------------------
    def has_ready(self) -> bool:
        return bool(self._ready)

    def get_ready_tasks(self) -> list[Task]:
        """Pop every ready task (highest priority first) and mark them in progress."""
        tasks = []
        while self._ready:
            task = heapq.heappop(self._ready)
            if self.status.get(task.node_id) is TaskStatus.PENDING:
                self.status[task.node_id] = TaskStatus.IN_PROGRESS
                self.in_progress[task.node_id] = task
                tasks.append(task)
        return tasks

    def mark_complete(self, node_id: str, result: TaskResult) -> list[str]:
        """Store the result; return the dependents that became ready."""
        self.in_progress.pop(node_id, None)
        self.status[node_id] = TaskStatus.COMPLETED
        self.results[node_id] = result
        ready = []
        for child in self.dependents[node_id]:
            if self.status.get(child) is not TaskStatus.BLOCKED:
                continue
            self.waiting[child] -= 1
            if self.waiting[child] == 0:
                self._make_ready(child)
                ready.append(child)
        return ready

    def mark_failed(self, node_id: str, error: BaseException) -> list[str]:
        """Fail the node and cancel every descendant; return the cancelled ids."""
        self.in_progress.pop(node_id, None)
        self.status[node_id] = TaskStatus.FAILED
        self.errors[node_id] = error
        cancelled = []
        for descendant in self.graph.descendants(node_id):
            if self.status.get(descendant) in (TaskStatus.BLOCKED, TaskStatus.PENDING):
                self.status[descendant] = TaskStatus.CANCELLED
                cancelled.append(descendant)
        return cancelled

    def requeue(self, node_id: str, *, retry: bool = False, rate_limited: bool = False) -> Task:
        """Put a node back in the ready queue (rate limit or retry) and restore cancelled descendants."""
        previous = self.in_progress.pop(node_id, None)
        retries = (previous.retry_count if previous else 0) + (1 if retry else 0)
        limits = (previous.rate_limit_count if previous else 0) + (1 if rate_limited else 0)
        self.errors.pop(node_id, None)
        for descendant in self.graph.descendants(node_id):
            if self.status.get(descendant) is TaskStatus.CANCELLED:
                self.status[descendant] = TaskStatus.BLOCKED
        return self._make_ready(node_id, retries, limits)

    def cancel_all(self) -> None:
        for node_id, status in self.status.items():
            if status in (TaskStatus.BLOCKED, TaskStatus.PENDING, TaskStatus.IN_PROGRESS):
                self.status[node_id] = TaskStatus.CANCELLED
        self._ready.clear()
        self.in_progress.clear()

    # -- progress -------------------------------------------------------------------------------------------
    def is_complete(self) -> bool:
        """True when nothing can make progress any more: every node is done, failed or cancelled (a node waiting
        for a retry delay stays in progress)."""
        return not self._ready and not self.in_progress

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def first_error(self) -> BaseException | None:
        for node_id in self.graph.topological_order():
            if node_id in self.errors:
                return self.errors[node_id]
        return None

    def value(self, node_id: str) -> Value:
        return self.results[node_id].value

    def get_outputs(self) -> Any:
        """The graph's output structure with each node id replaced by its Value."""
        return self._resolve(self.graph.output_structure)

    def _resolve(self, structure: Any) -> Any:
        if isinstance(structure, str):
            result = self.results.get(structure)
            return result.value if result is not None else None
        if isinstance(structure, dict):
            return {k: self._resolve(v) for k, v in structure.items()}
        if isinstance(structure, list):
            return [self._resolve(v) for v in structure]
        if isinstance(structure, tuple):
            return tuple(self._resolve(v) for v in structure)
        return structure
