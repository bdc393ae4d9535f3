"""The Celery side of node dispatch: routes nodes to queues and priorities, sends ``inf.run_node`` messages, and
reads queue depths from Redis. The jobs layer calls it through ``app.jobs.distributed.Dispatcher``."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from redis import Redis

from app.jobs.distributed.messages import NodeMessage
from app.jobs.distributed.transport.queues import (
    PRIORITY_LEVELS,
    Queues,
    node_task_id,
    route_node,
)
from app.pipeline.resources.config import EndpointConfig
from app.settings import Settings

RUN_NODE = "inf.run_node"


def queue_keys(settings: Settings, queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s messages: kombu keeps one list per priority level (level 0 under
    the queue's own name, level n under ``queue:n``), each under the Celery key prefix."""
    base = f"{settings.redis_prefix}:celery:{queue}"
    return [base, *(f"{base}:{level}" for level in range(1, PRIORITY_LEVELS))]


def queue_depth(redis: Redis, settings: Settings, queue: str) -> int:
    """Messages waiting in ``queue`` (not counting those a worker has taken and not acknowledged yet)."""
    with redis.pipeline(transaction=False) as pipe:
        for key in queue_keys(settings, queue):
            pipe.llen(key)
        return sum(int(n) for n in pipe.execute())


class CeleryDispatcher:
    """Sends node tasks on ``celery`` (deterministic task ids: job, item, node, attempt)."""

    def __init__(self, celery: Any, settings: Settings, group: int | None = None) -> None:
        self.celery = celery
        # ready nodes of one item that one message may carry (settings.node_group unless told)
        self.group = settings.node_group if group is None else group
        self.settings = settings
        self.queues = Queues.from_prefix(settings.celery_queue_prefix)
        self._redis: Redis | None = None

    def route(
        self, *, kind: str, endpoint: EndpointConfig | None, job_priority: int, depth: int
    ) -> tuple[str, int]:
        return route_node(self.queues, kind=kind, endpoint=endpoint, job_priority=job_priority, depth=depth)

    def send(self, messages: Sequence[NodeMessage]) -> None:
        if not messages:
            return
        with self.celery.producer_or_acquire() as producer:  # one connection for the whole batch
            # kombu >= 5.7 buffers a batch's publishes in one Redis pipeline (one round trip, one client) instead
            # of a client and a round trip per message; on an error nothing unflushed is sent, and the nodes
            # stay queued in PostgreSQL for the sweeper
            batch = producer.batch() if len(messages) > 1 and hasattr(producer, "batch") else nullcontext()
            with batch:
                for m in messages:
                    args: list[Any] = [m.job_id, m.item_id, m.node_id, m.attempt]
                    if m.also:  # a fifth argument only when used: older workers take four
                        args.append([list(pair) for pair in m.also])
                    self.celery.send_task(
                        RUN_NODE,
                        args=args,
                        task_id=node_task_id(m.job_id, m.item_id, m.node_id, m.attempt),
                        queue=m.queue,
                        priority=m.priority,
                        countdown=m.countdown or None,
                        producer=producer,
                    )

    def queue_depth(self, queue: str) -> int:
        if self._redis is None:
            self._redis = Redis.from_url(self.settings.redis_url or "", socket_timeout=10)
        return queue_depth(self._redis, self.settings, queue)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None
