"""The Celery configuration of inf-engine: Redis broker, at-least-once delivery, priority queues.

Celery is transport here, never the source of truth (PostgreSQL is): a task may be delivered twice, and a
re-delivered task finds its result stored and does nothing. The settings below make delivery at-least-once and
bounded; deploy/README.md explains each of them. The API builds a client app from them to send node tasks; the
workers' app (``workers.celery_app``) adds its task modules and beat's schedule.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from app.jobs.distributed.transport.queues import BASE_LEVEL, PRIORITY_LEVELS, Queues
from app.jobs.distributed.transport.redis_clients import check_kombu, share_redis_clients
from app.settings import Settings

# at import: a kombu without what redis_clients patches stops here with one line naming its version
check_kombu()


class RedisNotConfiguredError(RuntimeError):
    """Celery needs Redis; without it the server runs the node tasks on its in-process queue instead."""


def require_redis(settings: Settings) -> str:
    if not settings.redis_url:
        raise RedisNotConfiguredError(
            "no Redis configured: set INF_ENGINE_REDIS_URL (e.g. redis://127.0.0.1:6379/0) to run Celery "
            "workers, beat or Flower; without it, `inf-engine serve` runs jobs on its in-process queue"
        )
    return settings.redis_url


def queues_of(settings: Settings) -> Queues:
    return Queues.from_prefix(settings.celery_queue_prefix)


def celery_config(settings: Settings) -> dict[str, Any]:
    """Everything we set on Celery, as a plain dict (tested, and documented in deploy/README.md)."""
    queues = queues_of(settings)
    key_prefix = f"{settings.redis_prefix}:celery:"
    # Leave the worker a minute to clean up between the soft and the hard limit.
    soft_limit = max(1.0, settings.celery_task_time_limit - min(60.0, settings.celery_task_time_limit / 10))
    return {
        "broker_url": settings.redis_url,
        "result_backend": settings.redis_url,
        # At-least-once: acknowledge after the task ran, take one message at a time, and give a message back to
        # the queue when the process running it dies (the attempts cap lives in PostgreSQL, not here).
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        "task_reject_on_worker_lost": True,
        "task_time_limit": settings.celery_task_time_limit,
        "task_soft_time_limit": soft_limit,
        "broker_transport_options": {
            # Unacknowledged messages come back after this; it must exceed the longest task (the hard limit).
            "visibility_timeout": settings.celery_visibility_timeout,
            # Priority on Redis: one list per level 0..9, lowest level popped first.
            "queue_order_strategy": "priority",
            "priority_steps": list(range(PRIORITY_LEVELS)),
            "sep": ":",
            "global_keyprefix": key_prefix,
            "fanout_prefix": True,
            "fanout_patterns": True,
        },
        "result_backend_transport_options": {"global_keyprefix": key_prefix},
        "task_default_priority": BASE_LEVEL,
        "task_default_queue": queues.cpu,
        "task_queues": [
            Queue(name, Exchange(name, type="direct"), routing_key=name) for name in queues.all()
        ],
        "task_create_missing_queues": True,
        # Results live in PostgreSQL; only tasks that say so (ping) keep a Celery result, briefly.
        "task_ignore_result": True,
        "result_expires": 3600,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        # Flower sees tasks through the workers' events (settings.celery_task_events, on by default). No "sent"
        # events: workers send most node tasks, and one more publish per send costs them throughput (Flower
        # shows a task from "received" on); deploy/README.md.
        "worker_send_task_events": settings.celery_task_events,
        "task_send_sent_event": False,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "broker_connection_retry_on_startup": True,
        "enable_utc": True,
        "timezone": "UTC",
    }


def create_celery_app(
    settings: Settings, *, include: list[str] | None = None, beat_schedule: dict[str, Any] | None = None
) -> Celery:
    """A Celery app configured from ``settings``: a client that sends node tasks, or (with the task modules to
    ``include`` and beat's schedule) the workers' own app."""
    share_redis_clients()
    celery = Celery("inf_engine", include=include or [])
    celery.conf.update(celery_config(settings))
    if beat_schedule is not None:
        celery.conf.beat_schedule = beat_schedule
    return celery
