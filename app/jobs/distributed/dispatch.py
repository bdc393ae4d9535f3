"""Dispatching a job to workers: one node-task row per node of each item, and a message per ready node.

After the submission committed, the job moves queued → running and its items are taken a page at a time: each
page writes its node rows (``waiting`` = the dependencies each node waits for) in one transaction, then sends
the nodes that wait for nothing. Rows are inserted with ``ON CONFLICT DO NOTHING`` and only inserted rows are
sent, so a dispatch interrupted half-way is continued by the sweeper without sending anything twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import Item, ItemStatus, JobStatus, repository, session_scope, utcnow
from app.db.models import NodeTaskStatus
from app.db.repository import ItemOutcome
from app.db.repository import node_tasks as tasks_repo
from app.jobs.distributed.messages import Dispatcher, Endpoints, NodeMessage
from app.jobs.distributed.node_task import NodePolicy, messages_of
from app.jobs.distributed.settle import fail_item, settle_job
from app.jobs.encoding import decode_item_input, error_of
from app.jobs.graphs import graph_forms, load_module, trace_item

log = logging.getLogger(__name__)

PAGE_SIZE = 500
# A page of fewer items sends one node a message: grouping an item's ready nodes in one message runs them one
# after another, a good trade when many items keep every worker slot busy (a message costs a worker more than a
# node's bookkeeping) and a bad one when the item's own parallelism is all there is.
GROUP_MIN_ITEMS = 16
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
        waiting = len({dep for dep in n["dependencies"] if dep in runnable})  # a dependency counts once
        plans.append(NodePlan(n["node_id"], n["kind"], waiting, queue, priority))
    return plans


def missing_aliases(nodes: Sequence[dict[str, Any]], endpoints: Endpoints) -> list[str]:
    """Aliases the graph calls that the resources file does not define (none without a resources file)."""
    if endpoints.config is None:
        return []
    return sorted(
        {n["alias"] for n in nodes if n["kind"] == "llm" and n.get("alias")} - set(endpoints.config)
    )


def dispatch_job(
    sessions: sessionmaker[Session],
    job_id: str,
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    policy: NodePolicy | None = None,
    *,
    page_size: int = PAGE_SIZE,
) -> int:
    """Dispatch the job's undispatched items; returns the node tasks sent. A job that is not queued or running
    (cancelled meanwhile) is left alone."""
    policy = policy or NodePolicy()
    sent = 0
    plans: dict[str, list[NodePlan]] = {}
    size = min(FIRST_PAGE_SIZE, page_size)
    while True:
        with session_scope(sessions) as session:
            messages = _dispatch_page(session, job_id, dispatcher, endpoints, policy, plans, size)
        size = min(page_size, size * 2)
        if messages is None:
            return sent
        if messages:
            try:
                dispatcher.send(messages)
            except Exception as exc:  # the rows are queued: the sweeper sends them once the broker is back
                log.warning(
                    "job %s: could not send %d node tasks (%s); the sweeper will", job_id, len(messages), exc
                )
            sent += sum(m.nodes for m in messages)


def _dispatch_page(
    session: Session,
    job_id: str,
    dispatcher: Dispatcher,
    endpoints: Endpoints,
    policy: NodePolicy,
    plans: dict[str, list[NodePlan]],
    page_size: int,
) -> list[NodeMessage] | None:
    """One page of items in one transaction; None when nothing is left to dispatch."""
    job = repository.get_job(session, job_id=job_id)
    if job is None or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
        return None
    if job.status == JobStatus.QUEUED:
        tasks_repo.start_job(session, job_id=job_id)
    items = tasks_repo.items_without_node_tasks(session, job_id=job_id, limit=page_size)
    if not items:
        settle_job(session, job_id)
        return None
    deadline = utcnow() + timedelta(seconds=policy.stale_s)
    rows: list[dict[str, Any]] = []
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
        rows.extend(
            {
                "job_id": job_id,
                "item_id": item.id,
                "node_id": p.node_id,
                "kind": p.kind,
                "status": NodeTaskStatus.QUEUED if p.waiting == 0 else NodeTaskStatus.WAITING,
                "waiting": p.waiting,
                "queue": p.queue,
                "priority": p.priority,
                "deadline": deadline if p.waiting == 0 else None,
            }
            for p in item_plans
        )
    refs = tasks_repo.add_node_tasks(session, rows=rows)
    return messages_of(refs, getattr(dispatcher, "group", 1) if len(items) >= GROUP_MIN_ITEMS else 1)


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
    open_ids = repository.open_item_ids(session, job_id=job_id)
    repository.finish_items(
        session, job_id=job_id, outcomes=[ItemOutcome(i, ItemStatus.FAILED, None, error) for i in open_ids]
    )
    tasks_repo.close_job_node_tasks(session, job_id=job_id)
    repository.finish_job(session, job_id=job_id, status=JobStatus.FAILED, error=error)
