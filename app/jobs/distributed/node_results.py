"""Storing one node's result (step 3 of a node task, see :mod:`app.jobs.distributed.node_task`), through the
worker's node store:

* the node every other node of its item leads to stores its result with the item's outcome (``store_last``);
* a node without dependents stores its result and, when it was the item's last unfinished node, the item's
  outcome in the same transaction (``store_sink``);
* any other node stores its result and counts down its dependents (``store``); the cheap ``F.*`` ops that became
  ready run on the spot and are stored the same way, and the item is finished once an item's sink is stored.

Every store operation retries while the database is unreachable (:func:`retrying`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from app.db import JobStatus, utcnow
from app.db.repository.node_store import Hold, ItemEnd, NodeTaskRef, NodeValue, StoredValues
from app.jobs.distributed.node_worker import NodeWorker
from app.jobs.distributed.nodes import ItemGraph, item_outcome, run_op_node
from app.jobs.distributed.settle import item_end, item_metrics
from app.jobs.encoding import decode_value, encode_value
from app.jobs.endpoints import CostFn, endpoint_cost
from app.pipeline.execution.node_runner import is_inline
from app.pipeline.execution.state import TaskResult

log = logging.getLogger(__name__)

T = TypeVar("T")


def store_result(
    worker: NodeWorker, item: ItemGraph, result: TaskResult, hold: str | None = None
) -> list[NodeTaskRef]:
    """Store the result, count down the dependents, run ready inline ops, finish the item when it is done.
    Returns the nodes to send (none when the job stopped meanwhile: releasing checks that it is open); those on
    queue ``hold`` are held for the caller, which runs them next (marked sent: no refill sends them too)."""
    store = worker.store
    if _leads_everything(item, result.node_id):
        # the node every other node leads to: its result and the item's outcome in one statement
        item.values[result.node_id] = result.value
        retrying(worker, partial(store.store_last, _value(item, result), _last_end(worker, item)))
        return []
    if not item.dependents().get(result.node_id):
        # a node without dependents may be its item's last: its result and the item's outcome commit together
        item.values[result.node_id] = result.value
        retrying(worker, partial(store.store_sink, _value(item, result), _ender(worker, item)))
        return []
    reached_sink, to_send, job_status = retrying(worker, partial(_store_chain, worker, item, result, hold))
    if reached_sink:
        finish = partial(
            store.finish_item, job_id=item.job_id, item_id=item.item_id, end=_ender(worker, item)
        )
        retrying(worker, finish)
    if job_status == JobStatus.CANCELLING:  # this may have been its last running node
        retrying(worker, partial(store.settle, job_id=item.job_id))
    return to_send


def _leads_everything(item: ItemGraph, node_id: str) -> bool:
    """Every other runnable node of the item is an ancestor of ``node_id``, and the item's outputs are known once
    it is: when it is stored, the item is complete, with no need to look at the other nodes' rows."""
    graph = item.graph
    inputs = set(graph.input_ids)
    runnable = set(graph.nodes) - inputs
    seen: set[str] = set()
    todo = [node_id]
    while todo:
        for dep in graph.nodes[todo.pop()].dependencies:
            if dep not in seen and dep not in inputs:
                seen.add(dep)
                todo.append(dep)
    if seen != runnable - {node_id}:
        return False
    return all(n == node_id or n in inputs or n in item.values for n in graph.output_ids)


def _value(item: ItemGraph, result: TaskResult, now: datetime | None = None) -> NodeValue:
    return NodeValue(
        item.job_id,
        item.item_id,
        result.node_id,
        encode_value(result.value),
        round(result.duration_ms, 3),
        result.retry_count,
        now or utcnow(),
    )


def _last_end(worker: NodeWorker, item: ItemGraph) -> ItemEnd:
    outcome = item_outcome(item)
    assert outcome is not None  # _leads_everything checked that every output is known
    return ItemEnd(outcome.status, outcome.output, outcome.error, item_metrics(item, _cost(worker, item)))


def _ender(worker: NodeWorker, item: ItemGraph) -> Callable[[StoredValues], ItemEnd]:
    """Decides the item's outcome once every node of it is stored (reading the values it lacks)."""
    return partial(item_end, item, _cost(worker, item))


def _store_chain(
    worker: NodeWorker, item: ItemGraph, result: TaskResult, hold_queue: str | None = None
) -> tuple[bool, list[NodeTaskRef], str | None]:
    """Store ``result`` and the inline ops it makes ready, each with its dependents counted down; returns (an
    item's sink was stored, the nodes to send, the job's status)."""
    now = utcnow()
    deadline = now  # dependents that become ready may be sent at once (by the dispatch window's refill) ...
    # ... except the inline ops run below and those the caller runs next: the sweeper steps in if it dies first
    hold = Hold(hold_queue, now + timedelta(seconds=worker.policy.stale_s))
    dependents = item.dependents()
    to_send: list[NodeTaskRef] = []
    pending = [result]
    first = True
    reached_sink = False
    job_status: str | None = None
    while pending:
        current = pending.pop()
        waiting = sorted(set(dependents.get(current.node_id, [])))
        stored = worker.store.store(_value(item, current, now), dependents=waiting, deadline=deadline, hold=hold)
        job_status = stored.job_status
        if not stored.inserted:
            if first:  # another delivery stored it first, and released its dependents then
                return False, [], job_status
            continue
        first = False
        item.values[current.node_id] = current.value
        if not waiting:
            reached_sink = True  # only a node without dependents can be an item's last one
            continue
        inline = [r for r in stored.ready if is_inline(item.graph.nodes[r.node_id])]
        if inline:
            # their other inputs may have been stored by other workers: read them now (a store may have)
            values = stored.values
            if values is None:
                values = worker.store.item_values(item_id=item.item_id)
            known = item.values
            known.update(
                {n: decode_value(v) for n, v in values.items() if n in item.graph.nodes and n not in known}
            )
            pending.extend(run_op_node(item, r.node_id) for r in inline)
        to_send.extend(r for r in stored.ready if r not in inline)
    return reached_sink, to_send, job_status


def _cost(worker: NodeWorker, item: ItemGraph) -> CostFn | None:
    aliases = sorted({n.alias for n in item.graph.nodes.values() if n.kind == "llm" and n.alias})
    if not aliases:
        return None
    return partial(endpoint_cost, worker.resources_for(aliases))


def retrying(worker: NodeWorker, work: Callable[[], T]) -> T:
    """Run one store operation (or a chain of them), retrying while the database is unreachable (a restart, a
    failover): the node's result is kept in memory meanwhile instead of calling the endpoint again."""
    deadline = time.monotonic() + worker.policy.db_retry_s
    delay = 0.2
    while True:
        try:
            return work()
        except DBAPIError as exc:
            unreachable = exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError)
            if not unreachable or time.monotonic() + delay > deadline:
                raise
            log.warning("database unavailable (%s); retrying in %.1f s", str(exc.orig).strip(), delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
