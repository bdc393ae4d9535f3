"""The Celery tasks. Thin: take primitive ids, call one function in ``app/``, return.

* ``inf.run_node(job_id, item_id, node_id, attempt)``: one graph node of one item
  (:func:`app.jobs.distributed.run_node`: claim, run, store, release dependents, send the ready ones).
* ``inf.sweep``: the beat's sweeper (:func:`app.jobs.distributed.sweep`: lost workers and messages, expiry).
* ``inf.ping`` and ``inf.beat_heartbeat``: a bare round trip, and beat's liveness.
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task
from redis import Redis

from app.db import DATABASE_UNAVAILABLE
from app.jobs.distributed import NodeCall, run_node, sweep
from app.jobs.distributed.stages import Lap
from app.jobs.distributed.stages import clock as stage_clock
from app.settings import get_settings
from workers.beat import HEARTBEAT_EVERY_S, SingletonLock, heartbeat_key
from workers.runtime import node_worker, sweeper_parts

# the database unreachable before the node was claimed (a restart, a failover): nothing ran yet, retry later
DB_DOWN = DATABASE_UNAVAILABLE


@shared_task(
    name="inf.run_node",
    bind=True,
    autoretry_for=DB_DOWN,
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=30,
)
def run_node_task(
    self: Any, job_id: str, item_id: int, node_id: str, attempt: int, also: list[list[Any]] | None = None
) -> str:
    """Run one node of one item, together with ``also`` when the message carries more (``[node_id, attempt]`` of
    the same item, ``[node_id, attempt, item_id]`` of another); a re-delivered task whose results are stored
    does nothing."""
    request = self.request
    redelivered = bool(request.retries) or bool((request.delivery_info or {}).get("redelivered"))
    call = NodeCall(job_id, int(item_id), node_id, int(attempt), token=request.id, redelivered=redelivered)
    lap = Lap(stage_clock)
    # the queue it came from (routing key = queue name): dependents ready on it may run here at once
    here = (request.delivery_info or {}).get("routing_key") or None
    outcome = run_node(node_worker(self.app), call, here=here, also=[tuple(extra) for extra in also or []]).value
    lap("task")  # the whole body: the benchmark subtracts the stages inside it
    return outcome


@shared_task(name="inf.sweep", bind=True)
def sweep_task(self: Any) -> dict[str, int] | str:
    """Re-queue nodes whose worker vanished or whose message was lost, dispatch stalled jobs, expire jobs.
    One sweep at a time: a sweep slower than the beat's interval makes the next one step aside."""
    settings = get_settings()
    with Redis.from_url(settings.redis_url or "", socket_timeout=10) as redis:
        lock = SingletonLock(redis, f"{settings.redis_prefix}:sweep:lock", max(60.0, 5 * settings.sweep_interval))
        if not lock.try_acquire():
            return "skipped: another sweep is running"
        try:
            sessions, dispatcher, endpoints, policy = sweeper_parts(self.app)
            worker = node_worker(self.app)
            report = sweep(
                sessions, dispatcher, endpoints, policy, resources_for=worker.resources_for, window=worker.window
            )
            return vars(report)
        finally:
            lock.release()


@shared_task(name="inf.ping", ignore_result=False)
def ping(payload: Any = None) -> Any:
    """Do nothing and return ``payload``: a bare round trip through broker, worker and result backend, used by
    the platform benchmark and by health checks."""
    return payload


@shared_task(name="inf.beat_heartbeat")
def beat_heartbeat() -> float:
    """Record beat's last tick in Redis (expires after three missed ticks), so monitoring sees a dead beat."""
    settings = get_settings()
    now = time.time()
    with Redis.from_url(settings.redis_url or "") as redis:
        redis.set(heartbeat_key(settings), repr(now), ex=int(3 * HEARTBEAT_EVERY_S))
    return now
