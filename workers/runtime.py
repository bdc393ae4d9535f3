"""Per-process state of a worker, in one place with one fork hook: the node runtime, the sweeper's parts, the
learning worker and the engine host's event loop. Each is built on first use in the process that runs tasks
(after a prefork fork), never at import, so that database connections and event loops never cross a fork."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery.signals import celeryd_after_setup
from redis import Redis

from app.db import SessionFactory
from app.jobs.distributed import Endpoints, NodePolicy, NodeWorker
from app.jobs.distributed.monitoring import BufferedRecorder
from app.jobs.distributed.transport.celery_dispatch import CeleryDispatcher
from app.jobs.distributed.worker import build_node_worker, endpoints_of, node_policy
from app.jobs.distributed.worker_metrics import worker_metrics
from app.jobs.endpoints import EndpointResolver
from app.jobs.learning.worker import LearningWorker
from app.settings import Settings, get_settings
from workers.engine_host import LoopHost

log = logging.getLogger(__name__)

_lock = threading.RLock()
_worker: NodeWorker | None = None
_sweeper: tuple[SessionFactory, CeleryDispatcher, Endpoints, NodePolicy] | None = None
_learning: LearningWorker | None = None
_host: LoopHost | None = None
# node calls one process runs at once: the worker's task threads (set when the worker starts; 0 = no cap)
_max_calls = 0


@celeryd_after_setup.connect
def _remember_pool(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    """A message's nodes run together, so the task threads alone no longer bound the calls in flight: cap them
    at ``--concurrency`` per process for a thread pool, as before; a prefork child runs one task, so one call."""
    global _max_calls
    pool = str(getattr(instance, "pool_cls", "") or "").lower()
    threads = any(kind in pool for kind in ("thread", "gevent", "eventlet", "solo"))
    _max_calls = int(getattr(instance, "concurrency", 0) or 0) if threads else 1


def _reset_after_fork() -> None:
    # a forked child has the parent's objects but not their threads or connections: build fresh ones on first use
    global _lock, _worker, _sweeper, _learning, _host
    _lock = threading.RLock()
    _worker = None
    _sweeper = None
    _learning = None
    _host = None


os.register_at_fork(after_in_child=_reset_after_fork)


def engine_host() -> LoopHost:
    """This process's event loop for node calls (and its engine, on an --engine worker)."""
    global _host
    with _lock:
        if _host is None:
            _host = LoopHost()
        return _host


def learning_worker(settings: Settings) -> LearningWorker:
    """This process's LearningWorker (scheduled evaluations)."""
    global _learning
    with _lock:
        if _learning is None:
            _learning = LearningWorker(settings)
        return _learning


def node_worker(celery: Any) -> NodeWorker:
    """This process's node runtime: sessions, endpoints, the dispatcher on ``celery`` (the app running the task,
    passed in rather than imported, since ``workers.celery_app`` imports this module), the event loop, metrics."""
    global _worker
    if _worker is None:
        with _lock:
            if _worker is None:
                settings = get_settings()
                recorder = BufferedRecorder(Redis.from_url(settings.redis_url or "", socket_timeout=5),
                                            settings.redis_prefix)
                # the engine host registered the in-process engine with its own options
                resources = EndpointResolver(settings, on_wait=_quietly(recorder.rate_limit_wait),
                                             register_engine=False)
                _worker = build_node_worker(
                    settings,
                    CeleryDispatcher(celery, settings),
                    engine_host().submit,
                    resources_for=resources,
                    observe=_quietly(_both(recorder.node_finished, worker_metrics().node_finished)),
                    max_calls=_max_calls,
                )
    return _worker


def sweeper_parts(celery: Any) -> tuple[SessionFactory, CeleryDispatcher, Endpoints, NodePolicy]:
    """What the sweeper needs, once per process."""
    global _sweeper
    if _sweeper is None:
        with _lock:
            if _sweeper is None:
                settings = get_settings()
                worker = node_worker(celery) if _worker is None else _worker
                _sweeper = (worker.sessions, CeleryDispatcher(celery, settings), endpoints_of(settings),
                            node_policy(settings))
    return _sweeper


def _both(*records: Any) -> Any:
    """The cluster's node latencies (Redis, exported by the API) and this worker's own (its /metrics)."""

    def call(*args: Any) -> None:
        for record in records:
            record(*args)

    return call


def _quietly(record: Any) -> Any:
    """Metrics must never fail a task: a Redis hiccup loses one observation and a log line."""

    def call(*args: Any) -> None:
        try:
            record(*args)
        except Exception as exc:
            log.warning("could not record a platform metric: %s", exc)

    return call
