"""The workers' Celery app: the transport's configuration (``app.jobs.distributed.transport.celery_config``) plus
the task modules and beat's schedule.

``app`` is built from the process settings at import (``INF_ENGINE_REDIS_URL``, ``INF_ENGINE_REDIS_PREFIX``,
``INF_ENGINE_CELERY_*``); :func:`create_celery_app` builds another one from explicit settings (tests, tools).
"""

from __future__ import annotations

from celery import Celery

from app.jobs.distributed.transport import celery_config as transport
from app.jobs.distributed.transport.celery_config import RedisNotConfiguredError, celery_config, require_redis
from app.settings import Settings, exit_on_bad_settings, get_settings
from workers import (
    observability,  # noqa: F401  (JSON logs with task and job ids, worker presence)
    runtime,  # noqa: F401  (the pool size, which caps the node calls in flight)
    stages_control,  # noqa: F401  (inf_stages: per-stage node timers for the benchmark)
)
from workers.beat import beat_schedule

TASK_MODULES = ["workers.tasks", "workers.learning_tasks"]

__all__ = ["TASK_MODULES", "RedisNotConfiguredError", "app", "celery_config", "create_celery_app", "require_redis"]


def create_celery_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    return transport.create_celery_app(settings, include=TASK_MODULES, beat_schedule=beat_schedule(settings))


# `celery -A workers.celery_app ...` reads the settings here: a bad one ends it in one line, exit status 2.
with exit_on_bad_settings():
    app = create_celery_app()
