"""What the API adds when it is part of the distributed platform: the Celery dispatcher for jobs (when Redis is
configured) and the ``inf_engine_*`` metrics on ``/metrics``. Only wiring: the work is in ``app.jobs``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from redis import Redis

from app.db import JobStatus
from app.db.repository.platform_stats import job_status_counts, tenant_item_counts
from app.jobs.distributed.monitoring import ExportLeader, JobCounts, PlatformCollector
from app.jobs.runtime import JobsRuntime
from app.jobs.tenants import ANONYMOUS, KeyRing
from app.settings import Settings


def jobs_dispatcher(settings: Settings) -> Any:
    """Celery's dispatcher when Redis is configured (jobs then run on workers), else None (the in-process queue
    runs them, as on a bare machine)."""
    if not settings.redis_url:
        return None
    from app.jobs.distributed.transport.celery_config import create_celery_app
    from app.jobs.distributed.transport.celery_dispatch import CeleryDispatcher

    return CeleryDispatcher(create_celery_app(settings), settings)


def platform_health_probe(settings: Settings) -> Callable[[], dict[str, Any]] | None:
    """What /health reports about the workers (None without Redis: no workers to report)."""
    if not settings.redis_url:
        return None
    from app.jobs.distributed.presence import WorkerPresence, platform_health

    presence = WorkerPresence(
        Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2), settings.redis_prefix
    )
    return lambda: platform_health(presence, settings.celery_queue_prefix).as_dict()


def platform_collector(settings: Settings, jobs: JobsRuntime) -> PlatformCollector:
    from app.jobs.distributed.transport.celery_dispatch import queue_keys
    from app.jobs.distributed.transport.queues import Queues

    def job_counts() -> JobCounts | None:
        try:
            jobs.sessions  # noqa: B018  (raises while the jobs database is not open)
        except RuntimeError:  # no job was ever used in this process: nothing to count, and no database to create
            return None
        with jobs.session() as session:
            by_status, items = job_status_counts(session)
            tenant_items = tenant_item_counts(session)
        return JobCounts(by_status, items, tenant_items)

    lock = threading.Lock()
    client: list[Redis] = []

    def redis() -> Redis | None:
        if not settings.redis_url:
            return None
        with lock:
            if not client:
                client.append(Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2))
            return client[0]

    queues = {name: queue_keys(settings, name) for name in Queues.from_prefix(settings.celery_queue_prefix).all()}
    ring = KeyRing(settings.api_keys)
    tenants = sorted({ANONYMOUS} if ring.open else {entry.tenant for entry in ring.entries})  # shown even when idle
    # several API replicas share the database and Redis: only the holder of this lock exports what they share
    leader = ExportLeader(redis, f"{settings.redis_prefix}:metrics:leader") if settings.redis_url else None
    return PlatformCollector(job_counts, redis, settings.redis_prefix, queues, [s.value for s in JobStatus], tenants,
                             leader)

