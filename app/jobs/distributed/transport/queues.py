"""Queues, routing by node kind, and message priority. Pure functions: no Celery, no Redis.

Three queues, so that each kind of work gets the workers it needs and one kind cannot starve another:

* ``<prefix>.cpu``:    plain-Python nodes (inputs, ``F.*`` ops, user modules). Cheap, many per second.
* ``<prefix>.llm``:    LLM calls to remote endpoints (any provider with a URL). Mostly waiting on the network,
                       paced by the global limits in Redis.
* ``<prefix>.engine``: LLM calls to our engine in the worker's own process (provider ``native`` without a
                       ``base_url``). Only ``inf-engine worker --engine`` consumes it: one engine per process,
                       fed by many tasks at once so that continuous batching sees them together.

Priority on Redis: Celery splits each queue into one list per priority level and always pops the lowest level
first, so **a lower number runs sooner** (the same sense as a job's ``priority``: lower is more urgent). See
:func:`priority_for`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.pipeline.resources.config import EndpointConfig

NODE_KINDS = ("input", "op", "module", "llm")
PRIORITY_LEVELS = 10  # Celery priority 0..9 on Redis (priority_steps)
BASE_LEVEL = 6  # where a job of priority 0 starts
MAX_DEPTH_BOOST = 3  # deeper nodes move up at most this many levels
LOCAL_ENGINE_PROVIDERS = frozenset({"native"})


@dataclass(frozen=True, slots=True)
class Queues:
    """The queue names of one deployment (tests use their own prefix)."""

    cpu: str
    llm: str
    engine: str

    @classmethod
    def from_prefix(cls, prefix: str = "inf") -> Queues:
        return cls(cpu=f"{prefix}.cpu", llm=f"{prefix}.llm", engine=f"{prefix}.engine")

    def all(self) -> tuple[str, str, str]:
        return (self.cpu, self.llm, self.engine)

    def resolve(self, name: str) -> str:
        """``cpu``/``llm``/``engine`` → this deployment's queue; any other name is taken as a full queue name."""
        return {"cpu": self.cpu, "llm": self.llm, "engine": self.engine}.get(name, name)


DEFAULT_QUEUES = Queues.from_prefix()


def queue_for(
    node_kind: str,
    *,
    provider: str | None = None,
    base_url: str | None = None,
    queues: Queues = DEFAULT_QUEUES,
) -> str:
    """The queue a node's task goes to.

    ``node_kind`` is the kind stored with the graph node (``input``, ``op``, ``module``, ``llm``); for an ``llm``
    node, ``provider`` and ``base_url`` are those of the endpoint its alias resolves to. A ``native`` endpoint
    without a URL is the in-process engine (engine queue); with a URL it is an ``inf-engine serve`` elsewhere,
    reached over HTTP like any remote endpoint (llm queue).
    """
    if node_kind not in NODE_KINDS:
        raise ValueError(f"unknown node kind {node_kind!r}; expected one of {', '.join(NODE_KINDS)}")
    if node_kind != "llm":
        return queues.cpu
    if provider in LOCAL_ENGINE_PROVIDERS and not base_url:
        return queues.engine
    return queues.llm


def priority_for(job_priority: int, node_depth: int) -> int:
    """Celery priority (0 runs first, 9 last) of a node task: the job's priority plus a boost for deeper nodes.

    ``level = 6 + job_priority - min(node_depth, 3)``, clamped to 0..9. A job of priority 0 starts its items'
    first nodes at level 6; their children run at 5, 4, 3. So once an item has started, its next nodes overtake
    the first nodes of items not yet started: items finish (and stream out) early instead of every item
    advancing one node at a time, and the number of half-done items stays small. Job priorities -6..3 map to
    distinct starting levels; an urgent job (negative priority) beats the deep nodes of a normal one once it is
    more than 3 levels ahead.
    """
    if node_depth < 0:
        raise ValueError(f"node_depth must be >= 0, got {node_depth}")
    level = BASE_LEVEL + int(job_priority) - min(node_depth, MAX_DEPTH_BOOST)
    return max(0, min(PRIORITY_LEVELS - 1, level))


def route_node(
    queues: Queues, *, kind: str, endpoint: EndpointConfig | None, job_priority: int, depth: int
) -> tuple[str, int]:
    """``(queue, priority)`` of a node of ``kind`` whose alias resolves to ``endpoint`` (None: no LLM): what every
    transport's ``Dispatcher.route`` answers."""
    queue = queue_for(
        kind,
        provider=endpoint.provider if endpoint is not None else None,
        base_url=endpoint.base_url if endpoint is not None else None,
        queues=queues,
    )
    return queue, priority_for(job_priority, depth)


def node_task_id(job_id: str, item_id: str | int, node_id: str, attempt: int) -> str:
    """A deterministic task id for one attempt of one node of one item: enqueuing it twice is visible as such.

    Long ids (node ids come from user class names) are hashed so the id stays short and safe as a Redis key.
    """
    raw = f"{job_id}:{item_id}:{node_id}:{attempt}"
    if len(raw) <= 150 and raw.isascii():
        return raw
    return f"{job_id}:{hashlib.sha256(raw.encode()).hexdigest()[:32]}:{attempt}"
