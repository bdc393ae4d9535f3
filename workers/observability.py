"""Celery signal hooks of every worker and beat process: inf-engine's JSON logs (``app.logs``) with the task and
job ids of the task a line belongs to, the worker's announcement of the queues it consumes
(``app.jobs.distributed.presence``) and its own ``/metrics`` (``app.jobs.distributed.worker_metrics``). Imported by
``workers.celery_app``, so ``celery -A workers.celery_app`` gets them too."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from celery.signals import setup_logging, task_postrun, task_prerun, worker_ready, worker_shutdown
from redis import Redis

from app import logs
from app.jobs.distributed.presence import WorkerPresence
from app.jobs.distributed.worker_metrics import MetricsServer, worker_metrics
from app.settings import Settings, get_settings


def job_id_of(task_name: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str | None:
    """The job a task works for: ``inf.run_node(job_id, ...)``'s first argument, or a ``job_id`` keyword."""
    if kwargs and kwargs.get("job_id"):
        return str(kwargs["job_id"])
    if task_name == "inf.run_node" and args:
        return str(args[0])
    return None


@setup_logging.connect(weak=False)
def _json_logs(loglevel: Any = None, **_: Any) -> None:
    """Connected, this receiver replaces Celery's own log setup (its text format) in workers and beat."""
    logs.configure_logging(logs.level_name(loglevel, get_settings().log_level))


@task_prerun.connect(weak=False)
def _bind_task(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    logs.clear()
    logs.bind(task_id=task_id, job_id=job_id_of(getattr(task, "name", ""), args, kwargs))


@task_postrun.connect(weak=False)
def _unbind_task(**_: Any) -> None:
    logs.clear()


def announce_queues(settings: Settings, queues: Sequence[str], concurrency: int | None = None) -> None:
    """Once the worker is ready, announce ``queues`` and its task slots (``concurrency``: what the dispatch
    windows are sized from) under its node name until it shuts down."""
    state: dict[str, Any] = {}

    def ready(sender: Any = None, **_: Any) -> None:
        hostname = str(getattr(sender, "hostname", None) or "worker")
        presence = WorkerPresence(Redis.from_url(settings.redis_url or "", socket_timeout=5), settings.redis_prefix)
        stop = presence.keep_announcing(hostname, list(queues), concurrency)
        state.update(stop=stop, presence=presence, hostname=hostname)

    def shutdown(**_: Any) -> None:
        stop: threading.Event | None = state.get("stop")
        if stop is not None:
            stop.set()
            with contextlib.suppress(Exception):  # Redis away: the entry lapses with its TTL
                state["presence"].withdraw(state["hostname"])

    worker_ready.connect(ready, weak=False)
    worker_shutdown.connect(shutdown, weak=False)


def serve_metrics(
    settings: Settings, *, role: str, pool: str, queues: Sequence[str], slots: int
) -> MetricsServer | None:
    """Serve this worker's ``/metrics`` on ``worker_metrics_address:worker_metrics_port`` (None: the port is not
    set) until the worker shuts down; an engine worker's also carry its engine's ``vllm:*`` series. Raises
    OSError when the port is taken."""
    if settings.worker_metrics_port is None:
        return None
    metrics = worker_metrics()
    metrics.describe(role=role, pool=pool, queues=queues, slots=slots)
    if role == "engine":
        metrics.host_engines()

    def started(task: Any = None, **_: Any) -> None:
        metrics.task_started(getattr(task, "name", None) or "unknown")

    def finished(task: Any = None, state: str | None = None, **_: Any) -> None:
        metrics.task_finished(getattr(task, "name", None) or "unknown", state or "UNKNOWN")

    server = MetricsServer(metrics.registry, settings.worker_metrics_address, settings.worker_metrics_port)

    def shutdown(**_: Any) -> None:
        for signal, receiver in ((task_prerun, started), (task_postrun, finished), (worker_shutdown, shutdown)):
            signal.disconnect(receiver)
        server.close()

    task_prerun.connect(started, weak=False)
    task_postrun.connect(finished, weak=False)
    worker_shutdown.connect(shutdown, weak=False)
    return server
