"""What the jobs layer asks of a transport: route a node to a queue and a priority, send node tasks, and say how
many messages wait in a queue. ``workers/`` implements it on Celery; the jobs layer itself knows no Celery."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from app.db.repository.node_tasks import NodeTaskRef
from app.jobs.distributed.transport.queues import Queues
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
    carry (1, or no such attribute: one node a message). ``queues``: the queues it sends to."""

    queues: Queues

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


def message_of(ref: NodeTaskRef, countdown: float = 0.0) -> NodeMessage:
    """The message that sends ``ref`` (its attempt number is the attempts started so far)."""
    return NodeMessage(ref.job_id, ref.item_id, ref.node_id, ref.attempts, ref.queue, ref.priority, countdown)


def messages_of(refs: Sequence[NodeTaskRef], group: int = 1) -> list[NodeMessage]:
    """The messages that send ``refs``: up to ``group`` ready nodes of one job, queue and priority share one
    (an item's nodes side by side; a node of another item than the message's first names its item)."""
    if group <= 1:
        return [message_of(ref) for ref in refs]
    groups: dict[tuple[str, str, int], list[NodeTaskRef]] = {}
    for ref in sorted(refs, key=lambda r: r.item_id):
        groups.setdefault((ref.job_id, ref.queue, ref.priority), []).append(ref)
    messages = []
    for members in groups.values():
        for start in range(0, len(members), group):
            first, *rest = members[start : start + group]
            also = tuple(
                (r.node_id, r.attempts) if r.item_id == first.item_id else (r.node_id, r.attempts, r.item_id)
                for r in rest
            )
            messages.append(replace(message_of(first), also=also))
    return messages


class Endpoints:
    """Which endpoint each alias resolves to, for routing: the first configured endpoint of the alias; without a
    resources file, every alias is the in-process engine (provider native, no URL) of an engine worker."""

    def __init__(
        self,
        config: ResourceConfig | None,
        default_model: str | None = None,
        defines: Callable[[str], bool | None] | None = None,
    ) -> None:
        """``defines(alias)``: whether the process's endpoints serve ``alias`` (None: cannot tell), for endpoints
        given otherwise than by a resources file (a server's scripted resources in tests)."""
        self.config = config
        self.defines = defines
        self.default = EndpointConfig("native", default_model or "default")

    def of(self, alias: str | None) -> EndpointConfig | None:
        if alias is None:
            return None
        if self.config is None:
            return self.default
        endpoints = self.config.get(alias) if alias in self.config else None
        return endpoints[0] if endpoints else self.default
