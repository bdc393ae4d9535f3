"""What the jobs layer asks of a transport: route a node to a queue and a priority, send node tasks, and say how
many messages wait in a queue. ``workers/`` implements it on Celery; the jobs layer itself knows no Celery."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.pipeline.resources.config import EndpointConfig, ResourceConfig


@dataclass(frozen=True, slots=True)
class NodeMessage:
    """One node task to send: primitive ids only. ``attempt`` makes the task id (job, item, node, attempt), so
    sending the same attempt twice is visible as such; ``countdown`` delays it (a retry's backoff). ``also``: more
    ready nodes of the same job, queue and priority that the same delivery runs together with the first one (a
    message costs a worker more than a node's own bookkeeping): ``(node_id, attempt)`` of the first node's item,
    ``(node_id, attempt, item_id)`` of another item."""

    job_id: str
    item_id: int
    node_id: str
    attempt: int
    queue: str
    priority: int
    countdown: float = 0.0
    also: tuple[tuple[str, int] | tuple[str, int, int], ...] = ()

    @property
    def nodes(self) -> int:
        return 1 + len(self.also)


class Dispatcher(Protocol):
    """A transport. It may set ``group`` (an int attribute): how many ready nodes of one job one message may
    carry (1, or no such attribute: one node a message)."""

    def route(
        self, *, kind: str, endpoint: EndpointConfig | None, job_priority: int, depth: int
    ) -> tuple[str, int]:
        """``(queue, priority)`` of a node of ``kind`` whose alias resolves to ``endpoint`` (None: no LLM)."""
        ...

    def send(self, messages: Sequence[NodeMessage]) -> None:
        """Enqueue the node tasks (raise when the broker cannot take them)."""
        ...

    def queue_depth(self, queue: str) -> int:
        """Messages waiting in ``queue`` (all priority levels)."""
        ...


class Endpoints:
    """Which endpoint each alias resolves to, for routing: the first configured endpoint of the alias; without a
    resources file, every alias is the in-process engine (provider native, no URL) of an engine worker."""

    def __init__(self, config: ResourceConfig | None, default_model: str | None = None) -> None:
        self.config = config
        self.default = EndpointConfig("native", default_model or "default")

    def of(self, alias: str | None) -> EndpointConfig | None:
        if alias is None:
            return None
        if self.config is None:
            return self.default
        endpoints = self.config.get(alias) if alias in self.config else None
        return endpoints[0] if endpoints else self.default
