"""Dispatching a job to workers: one node-task row per node of each item; the dispatch windows send the ready ones.

After the submission committed, the job moves queued → running and its items are taken a page at a time: each
page writes its node rows (``waiting`` = the dependencies each node waits for; the nodes that wait for nothing
are ``queued``, not sent yet) in one transaction, then refills the dispatch windows
(:mod:`app.jobs.distributed.window`), which send what the broker has room for, fairly between jobs and
tenants. Rows are inserted with ``ON CONFLICT DO NOTHING``, so a dispatch interrupted half-way is continued by
the sweeper without writing anything twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import Item, ItemStatus, JobStatus, repository, session_scope
from app.db.models import NodeTaskStatus
from app.db.repository import node_tasks as tasks_repo
from app.jobs.distributed.messages import Dispatcher, Endpoints
from app.jobs.distributed.node_task import NodePolicy
from app.jobs.distributed.settle import fail_item, settle_job
from app.jobs.distributed.window import GROUP_MIN_ITEMS, DispatchWindow
from app.jobs.encoding import decode_item_input, error_of
from app.jobs.graphs import graph_forms, load_module, trace_item

log = logging.getLogger(__name__)

PAGE_SIZE = 500
__all__ = ["GROUP_MIN_ITEMS", "dispatch_job", "missing_aliases", "plan_graph"]

# the first page is small so that workers start at once; pages then double up to PAGE_SIZE
FIRST_PAGE_SIZE = 32


@dataclass(frozen=True, slots=True)
class NodePlan:
    """How one node of a graph is dispatched: the dependencies it waits for, its queue and its priority."""

    node_id: str
    kind: str
    waiting: int
    queue: str
    priority: int
    dependencies: frozenset[str] = frozenset()  # the runnable nodes it waits for


def plan_graph(
    nodes: Sequence[dict[str, Any]], endpoints: Endpoints, dispatcher: Dispatcher, job_priority: int
) -> list[NodePlan]:
    """The plan of a graph's nodes (rows of the graph_nodes table, as dicts); input nodes are never run."""
    runnable = {n["node_id"] for n in nodes if n["kind"] != "input"}
    plans = []
    for n in nodes:
        if n["kind"] == "input":
            continue
        endpoint = endpoints.of(n.get("alias")) if n["kind"] == "llm" else None
        queue, priority = dispatcher.route(
            kind=n["kind"], endpoint=endpoint, job_priority=job_priority, depth=int(n.get("depth") or 0)
        )
        dependencies = frozenset(dep for dep in n["dependencies"] if dep in runnable)  # a dependency counts once
        plans.append(NodePlan(n["node_id"], n["kind"], len(dependencies), queue, priority, dependencies))
    return plans


def missing_aliases(nodes: Sequence[dict[str, Any]], endpoints: Endpoints) -> list[str]:
    """Aliases the graph calls that the resources file (or the endpoints' ``defines``) does not define; none when
    every alias goes to the in-process engine."""
    aliases = {n["alias"] for n in nodes if n["kind"] == "llm" and n.get("alias")}
    if endpoints.config is not None:
        return sorted(aliases - set(endpoints.config))
    if endpoints.defines is not None:
        return sorted(a for a in aliases if endpoints.defines(a) is False)
    return []


def dispatch_job(
    sessions: sessionmaker[Session],
    job_id: str,
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    policy: NodePolicy | None = None,
    *,
    page_size: int = PAGE_SIZE,
    window: DispatchWindow | None = None,
) -> int:
    """Write the node rows of the job's undispatched items, refilling the dispatch windows after each page;
    returns the node rows made ready. A job that is not queued or running (cancelled meanwhile) is left alone.
    ``window``: the process's dispatch windows (default: fixed windows without quotas)."""
    policy = policy or NodePolicy()
    if window is None:
        window = DispatchWindow.fixed(sessions, dispatcher, policy.stale_s)
    ready = 0
    plans: dict[str, list[NodePlan]] = {}
    size = min(FIRST_PAGE_SIZE, page_size)
    while True:
        with session_scope(sessions) as session:
            written = _dispatch_page(session, job_id, dispatcher, endpoints, plans, size)
        size = min(page_size, size * 2)
        if written is None:
            _refill(window, job_id)
            return ready
        ready += written
        if written:
            _refill(window, job_id)


def _refill(window: DispatchWindow, job_id: str) -> None:
    try:
        window.refill()
    except Exception as exc:  # the rows are queued: the next refill (a worker's, the sweeper's) sends them
        log.warning("job %s: could not refill the dispatch windows (%s); the next refill will", job_id, exc)


def _dispatch_page(
    session: Session,
    job_id: str,
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    plans: dict[str, list[NodePlan]],
    page_size: int,
) -> int | None:
    """One page of items in one transaction: the number of ready nodes written; None when nothing is left."""
    job = repository.get_job(session, job_id=job_id)
    if job is None or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
        return None
    if job.status == JobStatus.QUEUED:
        repository.claim_job(session, job_id=job_id)
    items = tasks_repo.items_without_node_tasks(session, job_id=job_id, limit=page_size)
    if not items:
        settle_job(session, job_id)
        return None
    rows: list[dict[str, Any]] = []
    # results stored before the item had node rows (a job an older server's executor started): those nodes are
    # done, and their dependents wait only for the rest
    stored = repository.stored_node_ids(session, item_ids=[item.id for item in items])
    for item in items:
        try:
            item_plans = _plans_for(session, job, item, dispatcher, endpoints, plans)
        except _JobError as exc:
            _fail_job(session, job_id, exc.error)
            return None
        except Exception as exc:
            fail_item(session, job_id, item.id, error_of(exc))
            continue
        if not item_plans:  # the pipeline returns its inputs: nothing to run
            fail_item(
                session,
                job_id,
                item.id,
                {
                    "type": "EmptyGraph",
                    "message": "the pipeline makes no calls and runs no code on this item",
                },
            )
            continue
        rows.extend(_node_rows(job_id, item.id, item_plans, stored.get(item.id, set())))
    return len(tasks_repo.add_node_tasks(session, rows=rows))


def _node_rows(job_id: str, item_id: int, plans: list[NodePlan], stored: set[str]) -> list[dict[str, Any]]:
    rows = []
    for p in plans:
        waiting = len(p.dependencies - stored) if stored else p.waiting
        status = NodeTaskStatus.DONE if p.node_id in stored else (
            NodeTaskStatus.QUEUED if waiting == 0 else NodeTaskStatus.WAITING
        )
        rows.append({
            "job_id": job_id,
            "item_id": item_id,
            "node_id": p.node_id,
            "kind": p.kind,
            "status": status,
            "waiting": waiting,
            "queue": p.queue,
            "priority": p.priority,
            "deadline": None,  # a ready node may be sent at once; sent_at stays null until it is
        })
    return rows


class _JobError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


def _plans_for(
    session: Session,
    job: Any,
    item: Item,
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    plans: dict[str, list[NodePlan]],
) -> list[NodePlan]:
    key = item.graph_hash or f"item:{item.id}"
    cached = plans.get(key)
    if cached is not None:
        return cached
    nodes: list[dict[str, Any]] = []
    if item.graph_hash is not None:
        nodes = [
            {
                "node_id": n.node_id,
                "kind": n.kind,
                "alias": n.alias,
                "dependencies": list(n.dependencies),
                "depth": n.depth,
            }
            for n in repository.graph_nodes(session, pipeline_id=job.pipeline_id, graph_hash=item.graph_hash)
        ]
    if not nodes:  # no stored graph for this item: trace it
        pipeline = repository.get_pipeline(session, pipeline_id=job.pipeline_id)
        try:
            module = load_module(job.pipeline_name, dict(pipeline.parameter_state or {}) if pipeline else {})
        except Exception as exc:
            raise _JobError(
                {"type": type(exc).__name__, "message": f"the pipeline cannot be loaded: {exc}"}
            ) from None
        args, kwargs = decode_item_input(item.input)
        _, _, nodes = graph_forms(trace_item(module, args, kwargs))
    missing = missing_aliases(nodes, endpoints)
    if missing:
        raise _JobError(
            {
                "type": "ConfigurationError",
                "message": f"the pipeline calls the endpoint alias(es) {', '.join(missing)}, which the resources file "
                "(INF_ENGINE_RESOURCES_FILE) does not define: add them, then submit the job again",
            }
        )
    plans[key] = plan_graph(nodes, endpoints, dispatcher, job.priority)
    return plans[key]


def _fail_job(session: Session, job_id: str, error: dict[str, Any]) -> None:
    """A job-level problem (the pipeline cannot load, endpoints missing): every open item fails with it."""
    repository.close_open_items(session, job_id=job_id, status=ItemStatus.FAILED, error=error)
    tasks_repo.close_job_node_tasks(session, job_id=job_id)
    repository.finish_job(session, job_id=job_id, status=JobStatus.FAILED, error=error)
