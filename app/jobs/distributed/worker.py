"""A process's node runtime, built from Settings: database sessions, the dispatch windows, and the dispatcher,
event loop (``submit``) and endpoints the process supplies. Celery workers and the server's in-process queue
build it the same way."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from app.db import create_db_engine, database_url, make_session_factory
from app.db.direct import DirectPool
from app.jobs.distributed.messages import Dispatcher, Endpoints
from app.jobs.distributed.node_task import NodePolicy, NodeWorker
from app.jobs.distributed.presence import WorkerPresence
from app.jobs.distributed.transport.queues import Queues
from app.jobs.distributed.window import Capacity, DispatchWindow, WindowPolicy
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


def endpoints_of(settings: Settings, defines: Callable[[str], bool | None] | None = None) -> Endpoints:
    """Where aliases go: the resources file's endpoints, else the in-process engine of engine workers;
    ``defines``: see :class:`Endpoints`."""
    config = (
        ResourceConfig.from_file(settings.resources_file) if settings.resources_file is not None else None
    )
    return Endpoints(config, settings.model, defines)


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
    settings: Settings,
    sessions: sessionmaker[Session],
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    *,
    capacity: Capacity | None = None,
    coalesce_s: float = REFILL_COALESCE_S,
) -> DispatchWindow:
    """The process's dispatch windows, sized from ``capacity``, else the workers' announced task slots in Redis;
    ``coalesce_s``: deliveries ending within it share one refill."""
    if capacity is None and settings.redis_url:
        presence = WorkerPresence(Redis.from_url(settings.redis_url, socket_timeout=5), settings.redis_prefix)
        capacity = presence.capacity
    policy = window_policy(settings, endpoints, getattr(dispatcher, "group", 1))
    return DispatchWindow(sessions, dispatcher, policy, capacity=capacity, coalesce_s=coalesce_s)


def open_node_database(
    settings: Settings, *, threads: int = 0
) -> tuple[sessionmaker[Session], DirectPool | None]:
    """Sessions for node work and, on PostgreSQL, the raw autocommit connections of the one-statement claim and
    store. Connections are held for one statement or one short transaction, so a few serve many task threads (a
    thread waits for one when all are busy); at most 12 + 24 per process keeps several workers, the API and beat
    under PostgreSQL's default of 100 connections. ``threads``: the task threads of an in-process queue (on
    SQLite each gets its own connection)."""
    url = database_url(settings)
    options: dict[str, Any] = {"pool_size": 4, "max_overflow": 8}
    direct = None
    if threads and not url.startswith("postgresql"):  # SQLite: a connection per task thread costs nothing
        options = {"pool_size": threads, "max_overflow": 4}
    if url.startswith("postgresql"):
        # A node's commit need not wait for its WAL flush: a PostgreSQL crash may forget the last moments of
        # commits, which the leases, attempts and sweeper already handle as a worker that died mid-node.
        options["connect_args"] = {"options": "-c synchronous_commit=off"}
        direct = DirectPool(url, size=24, options="-c synchronous_commit=off")
    return make_session_factory(create_db_engine(url, **options)), direct


def build_node_worker(
    settings: Settings,
    dispatcher: Dispatcher,
    submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future[Any]],
    *,
    resources_for: Callable[[list[str]], Any],
    observe: Callable[[str, float], None] | None = None,
    max_calls: int = 0,
    database: tuple[sessionmaker[Session], DirectPool | None] | None = None,
    capacity: Capacity | None = None,
    coalesce_s: float = REFILL_COALESCE_S,
) -> NodeWorker:
    """The node runtime of one process, the same for every transport: ``dispatcher`` (Celery's, or the server's
    in-process queue), ``submit`` (the process's event loop), ``resources_for`` (an
    :class:`~app.jobs.endpoints.EndpointResolver`), ``database`` (default: :func:`open_node_database`),
    ``capacity`` (the task slots consuming each queue; default: the workers' announcements in Redis)."""
    sessions, direct = database if database is not None else open_node_database(settings)
    return NodeWorker(
        sessions=sessions,
        window=dispatch_window(
            settings, sessions, dispatcher, endpoints_of(settings), capacity=capacity, coalesce_s=coalesce_s
        ),
        direct=direct,
        group_commit=settings.node_store_group_commit,
        dispatcher=dispatcher,
        resources_for=resources_for,
        submit=submit,
        policy=node_policy(settings),
        observe=observe,
        max_calls=max_calls,
    )
