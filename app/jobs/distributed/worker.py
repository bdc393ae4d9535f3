"""A worker process's node runtime, built from Settings: database sessions, endpoints behind the global limits,
and the dispatcher and event loop (``submit``) the worker supplies."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from sqlalchemy.orm import Session, sessionmaker

from app.db import create_db_engine, database_url, make_session_factory
from app.db.direct import DirectPool
from app.jobs.distributed.limited import GloballyLimitedResources, WaitHook
from app.jobs.distributed.messages import Dispatcher, Endpoints
from app.jobs.distributed.node_task import NodePolicy, NodeWorker
from app.jobs.distributed.presence import WorkerPresence
from app.jobs.distributed.transport.queues import Queues
from app.jobs.distributed.window import DispatchWindow, WindowPolicy
from app.jobs.limits.fairness import endpoints_cap
from app.jobs.limits.quotas import QuotaTable
from app.pipeline.resources import ResourceConfig
from app.settings import Settings


def node_policy(settings: Settings) -> NodePolicy:
    return NodePolicy(
        lease_s=settings.node_lease_seconds,
        max_attempts=settings.node_max_attempts,
        retry_delay_s=settings.node_retry_delay,
        stale_s=settings.node_stale_seconds,
        local_chain=settings.node_local_chain,
    )


def endpoints_of(settings: Settings) -> Endpoints:
    """Where aliases go: the resources file's endpoints, else the in-process engine of engine workers."""
    config = (
        ResourceConfig.from_file(settings.resources_file) if settings.resources_file is not None else None
    )
    return Endpoints(config, settings.model)


REFILL_COALESCE_S = 0.1  # deliveries ending within this share one refill of the dispatch windows


def window_policy(settings: Settings, endpoints: Endpoints, group: int = 1) -> WindowPolicy:
    """The dispatch windows' settings: their size, the llm queue's cap from the endpoints' concurrency, the
    tenants' weights and in-flight quotas."""
    caps: dict[str, int] = {}
    llm_cap = endpoints_cap(endpoints.config)
    if llm_cap:
        caps[Queues.from_prefix(settings.celery_queue_prefix).llm] = llm_cap
    quotas = QuotaTable.from_settings(settings)
    return WindowPolicy(
        window=settings.dispatch_window,
        caps=caps,
        weights=dict(settings.tenant_weights),
        tenant_quota=lambda tenant: quotas.for_tenant(tenant).max_inflight_nodes,
        stale_s=settings.node_stale_seconds,
        group=group,
    )


def dispatch_window(
    settings: Settings, sessions: sessionmaker[Session], dispatcher: Dispatcher, endpoints: Endpoints
) -> DispatchWindow:
    """The process's dispatch windows, sized from the workers' announced task slots in Redis."""
    capacity = None
    if settings.redis_url:
        presence = WorkerPresence(Redis.from_url(settings.redis_url, socket_timeout=5), settings.redis_prefix)
        capacity = presence.capacity
    policy = window_policy(settings, endpoints, getattr(dispatcher, "group", 1))
    return DispatchWindow(sessions, dispatcher, policy, capacity=capacity, coalesce_s=REFILL_COALESCE_S)


class WorkerResources:
    """The endpoints of this process, one manager per configuration (every job and thread shares it)."""

    def __init__(self, settings: Settings, on_wait: WaitHook | None = None) -> None:
        self.settings = settings
        self.on_wait = on_wait
        self._managers: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()

    def __call__(self, aliases: list[str]) -> Any:
        settings = self.settings
        key: tuple[str, ...] = ("file",) if settings.resources_file is not None else ("engine", *aliases)
        with self._lock:
            manager = self._managers.get(key)
            if manager is None:
                manager = self._build(aliases)
                self._managers[key] = manager
            return manager

    def _build(self, aliases: list[str]) -> Any:
        settings = self.settings
        if settings.resources_file is not None:
            if not settings.redis_url:
                raise RuntimeError("workers need INF_ENGINE_REDIS_URL for the endpoints' global limits")
            url = settings.redis_url
            return GloballyLimitedResources(
                ResourceConfig.from_file(settings.resources_file),
                lambda: AsyncRedis.from_url(url),
                prefix=settings.redis_prefix,
                on_wait=self.on_wait,
            )
        # no resources file: the engine in this process (an `inf-engine worker --engine`)
        from app.pipeline.resources import ResourceManager
        from app.serving.embedded import embedded_resources

        return ResourceManager(embedded_resources(aliases, settings.model))

    async def aclose(self) -> None:
        for manager in self._managers.values():
            await manager.aclose()
        self._managers.clear()


def build_node_worker(
    settings: Settings,
    dispatcher: Dispatcher,
    submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future[Any]],
    *,
    observe: Callable[[str, float], None] | None = None,
    on_wait: WaitHook | None = None,
    max_calls: int = 0,
) -> NodeWorker:
    url = database_url(settings)
    # Connections are held for one statement or one short transaction, so a few serve many task threads (a
    # thread waits for one when all are busy); at most 12 + 24 per worker process keeps several workers, the API
    # and beat under PostgreSQL's default of 100 connections.
    options: dict[str, Any] = {"pool_size": 4, "max_overflow": 8}
    if url.startswith("postgresql"):
        # A node's commit need not wait for its WAL flush: a PostgreSQL crash may forget the last moments of
        # commits, which the leases, attempts and sweeper already handle as a worker that died mid-node.
        options["connect_args"] = {"options": "-c synchronous_commit=off"}
    engine = create_db_engine(url, **options)
    direct = None
    if url.startswith("postgresql"):  # the one-statement claim and store run on raw autocommit connections
        direct = DirectPool(url, size=24, options="-c synchronous_commit=off")
    sessions = make_session_factory(engine)
    return NodeWorker(
        sessions=sessions,
        window=dispatch_window(settings, sessions, dispatcher, endpoints_of(settings)),
        direct=direct,
        group_commit=settings.node_store_group_commit,
        dispatcher=dispatcher,
        resources_for=WorkerResources(settings, on_wait),
        submit=submit,
        policy=node_policy(settings),
        observe=observe,
        max_calls=max_calls,
    )
