"""One node of one item, run by a worker: the function behind the Celery node task.

``run_node(worker, call)``:

1. claims the node (the worker's node store, :mod:`app.db.repository.node_store`): nothing to do if its result
   is stored, its job or item is closed, or another live delivery holds it; fails the item cleanly once the
   node was started ``max_attempts`` times; otherwise marks it running with a lease (renewed while it runs) and
   loads the item's stored node values;
2. runs it (an LLM call goes through the endpoint's global limits; a 429 is reported there and retried);
3. stores the result with ``INSERT ... ON CONFLICT DO NOTHING`` and, in the same transaction, counts down the
   waiting dependencies of its dependents, runs the cheap ``F.*`` ops that became ready on the spot (storing
   each the same way), and finishes the item (and the job) when nothing is left: the node every other node
   leads to stores the item's outcome with its own result, a node without dependents finishes the item in its
   store's transaction when it was the last one;
4. after the commit, sends the nodes that became ready.

Transient failures (a timeout, a 5xx, a dropped connection) are queued again with exponential backoff, within
the endpoint's ``max_retries`` and the attempts cap; other failures fail the item with the error. While the
database is unreachable (a restart, a failover), storing retries: the result is kept in memory meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from functools import partial
from typing import Any
from uuid import uuid4

from app.db import utcnow
from app.db.repository.node_store import Claim, ClaimRequest, ClaimStatus, NodeTaskRef
from app.jobs.distributed.messages import NodeMessage, message_of, messages_of
from app.jobs.distributed.node_results import retrying, store_result
from app.jobs.distributed.node_worker import NodeCall, NodePolicy, NodeWorker
from app.jobs.distributed.nodes import ItemGraph, execute_node
from app.jobs.distributed.stages import Lap, clock
from app.jobs.encoding import decode_value, error_of
from app.pipeline.execution.state import TaskResult
from app.pipeline.resources.errors import RateLimitError, TransientError

__all__ = ["NodeCall", "NodePolicy", "NodeWorker", "Outcome", "message_of", "messages_of", "run_node"]

log = logging.getLogger(__name__)

MAX_RETRY_DELAY_S = 60.0


class Outcome(StrEnum):
    """What one delivery of a node task did."""

    STORED = "stored"  # ran, stored its result, sent the nodes that became ready
    ALREADY_DONE = "already_done"  # a re-delivered or duplicate task: the result was stored before
    BUSY = "busy"  # another live delivery runs it
    CLOSED = "closed"  # its job or item is no longer open (cancelled, failed, expired)
    NOT_READY = "not_ready"  # its dependencies are not stored yet (a stray message)
    RETRY = "retry"  # a transient failure: queued again with a countdown
    FAILED = "failed"  # the item failed (the node's error, or the attempts cap)


_REFUSED = {
    ClaimStatus.ALREADY_DONE: Outcome.ALREADY_DONE,
    ClaimStatus.BUSY: Outcome.BUSY,
    ClaimStatus.CLOSED: Outcome.CLOSED,
    ClaimStatus.NOT_READY: Outcome.NOT_READY,
    ClaimStatus.EXHAUSTED: Outcome.FAILED,
}


def run_node(
    worker: NodeWorker, call: NodeCall, *, here: str | None = None, also: Sequence[Sequence[Any]] = ()
) -> Outcome:
    """Claim, run and store one node, then send the nodes that became ready (see the module docstring).

    ``also``: the message's other nodes, ``(node_id, attempt)`` of the same item or ``(node_id, attempt,
    item_id)`` of another item of the job. They run under the same token, so a re-delivery of this message
    takes over their claims as it does the first one's. All of them run at once: each is claimed and its call
    handed to the event loop in turn, then each is stored as its call returns.

    ``here``: the queue this delivery came from. Dependents that become ready on that queue run in this task at
    once (claimed and stored in PostgreSQL as usual, together as above) instead of taking a round trip through
    the broker: this worker consumes that queue, and a message costs the worker more than most nodes do. Until
    its claim, a dependent is queued in PostgreSQL with a deadline, so the sweeper sends it if this worker dies
    meanwhile. At most ``policy.local_chain`` rounds of dependents run this way per delivery, so one message
    never holds a thread long. Returns the first node's outcome.
    """
    lap = Lap(clock)  # per-stage timers (two clock reads a stage), read by the platform benchmark
    calls = [call, *(_also_call(call, extra) for extra in also)]
    rounds = worker.policy.local_chain if here is not None else 0
    outcomes, ready = _run_round(worker, calls, lap, here if rounds else None)
    for round_ in range(rounds):
        local = [ref for ref in ready if ref.queue == here]
        if not local:
            break
        if len(local) < len(ready):  # dependents on other queues wait for their windows
            _refill(worker)
            lap("publish")
        # fresh tokens: no message carries these runs, so no redelivery can take them over (the sweeper can);
        # the dependents of the last round are left to the windows, not held for a round that does not come
        _, ready = _run_round(
            worker,
            [NodeCall(r.job_id, r.item_id, r.node_id, r.attempts, f"here:{uuid4().hex}") for r in local],
            lap,
            here if round_ + 1 < rounds else None,
        )
    # this delivery's slot is free and its dependents are ready (queued, not sent): the fair dispatcher decides
    # what the broker gets next, this job's dependents or another tenant's nodes
    _refill(worker)
    lap("publish")
    return outcomes[0]


def _also_call(call: NodeCall, extra: Sequence[Any]) -> NodeCall:
    item_id = int(extra[2]) if len(extra) > 2 else call.item_id
    return NodeCall(call.job_id, item_id, str(extra[0]), int(extra[1]), call.token, call.redelivered)


@dataclass
class _Running:
    """A claimed node whose call runs on the event loop."""

    index: int  # its place in the round's calls
    call: NodeCall
    item: ItemGraph
    attempts: int
    future: concurrent.futures.Future[TaskResult]
    start: float


def _run_round(
    worker: NodeWorker, calls: Sequence[NodeCall], lap: Lap, hold: str | None = None
) -> tuple[list[Outcome], list[NodeTaskRef]]:
    """Claim each node and start its call, then store each result as it comes; returns every node's outcome
    (in ``calls`` order) and the nodes that became ready (those on queue ``hold`` held for this delivery's next
    round, the others not sent yet)."""
    outcomes: list[Outcome] = [Outcome.STORED] * len(calls)
    running: list[_Running] = []
    start = 0
    while start < len(calls):
        # as many nodes as there are free call slots (at least one, waited for), claimed together
        taken = worker.take_call_slots(len(calls) - start)
        batch = range(start, start + taken)
        start += taken
        try:
            claims = _claim_many(worker, [calls[i] for i in batch], lap)
        except BaseException:
            worker.give_call_slots(taken)
            raise
        for index, claimed in zip(batch, claims, strict=True):
            if isinstance(claimed, Outcome):
                outcomes[index] = claimed
                worker.give_call_slots(1)
                continue
            running.append(_start(worker, index, calls[index], *claimed))
    ready: list[NodeTaskRef] = []
    for done in _as_completed(worker, running):
        outcomes[done.index], refs = _finish(worker, done, lap, hold)
        ready.extend(refs)
    return outcomes, ready


def _start(worker: NodeWorker, index: int, call: NodeCall, item: ItemGraph, attempts: int) -> _Running:
    """Hand the node's call to the event loop; its call slot is given back when the call ends."""
    try:
        future = worker.submit(_execute(worker, item, call.node_id, attempts))
    except BaseException:
        worker.give_call_slots(1)
        raise
    future.add_done_callback(lambda _: worker.give_call_slots(1))
    return _Running(index, call, item, attempts, future, time.perf_counter())


def _as_completed(worker: NodeWorker, running: list[_Running]) -> Iterator[_Running]:
    """The running nodes as their calls return, renewing the leases of those still running every third of a
    lease (from this task thread, so the event loop does no bookkeeping for them): the sweeper leaves a live
    node alone."""
    pending = {r.future: r for r in running}
    period = worker.policy.lease_s / 3
    renewed = time.monotonic()
    while pending:
        wait = max(0.0, renewed + period - time.monotonic())
        done, _ = concurrent.futures.wait(pending, timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)
        if time.monotonic() - renewed >= period:  # also while other calls keep returning
            for future, r in pending.items():
                if future not in done:
                    _renew(worker, r.call)
            renewed = time.monotonic()
        for future in done:
            yield pending.pop(future)


def _give_back(worker: NodeWorker, call: NodeCall) -> None:
    """A call was cancelled (its job was cancelled, or its process stops): the node is queued again, unclaimed,
    so a cancelled job settles at once and a stopped process's node runs again (the sweeper, or the next start of
    an in-process queue, sends it)."""
    try:
        deadline = utcnow() + timedelta(seconds=worker.policy.stale_s)
        worker.store.requeue(item_id=call.item_id, node_id=call.node_id, token=call.token, deadline=deadline)
        worker.store.settle(job_id=call.job_id)
    except Exception as exc:  # the lease lapses instead
        log.warning("could not give back the cancelled node %s: %s", call.token, exc)


def _renew(worker: NodeWorker, call: NodeCall) -> None:
    try:
        deadline = utcnow() + timedelta(seconds=worker.policy.lease_s)
        worker.store.renew(item_id=call.item_id, node_id=call.node_id, token=call.token, deadline=deadline)
    except Exception as exc:  # the database is away: the lease may lapse, and a re-run is harmless
        log.warning("cannot renew the lease of %s: %s", call.token, exc)


def _finish(
    worker: NodeWorker, r: _Running, lap: Lap, hold: str | None = None
) -> tuple[Outcome, list[NodeTaskRef]]:
    """Store a returned call's result (or retry or fail the node on its error). A call cancelled by its process
    stopping leaves the node claimed: its lease lapses (or the next start of an in-process queue hands it back)."""
    if r.future.cancelled():
        _give_back(worker, r.call)
        return Outcome.CLOSED, []
    try:
        result = r.future.result()
    except TransientError as exc:
        return _retry_or_fail(worker, r.call, r.item, r.attempts, exc), []
    except Exception as exc:  # the node's own error: the item fails with it (errors are data)
        _fail(worker, r.call, _node_error(r.call.node_id, exc))
        return Outcome.FAILED, []
    if worker.observe is not None:
        worker.observe(r.item.graph.nodes[r.call.node_id].kind, time.perf_counter() - r.start)
    lap("call")
    ready = store_result(worker, r.item, result, hold)
    lap("store")
    return Outcome.STORED, ready


# -- 1. claim ------------------------------------------------------------------------------------------------
def _claim_many(
    worker: NodeWorker, calls: Sequence[NodeCall], lap: Lap
) -> list[Outcome | tuple[ItemGraph, int]]:
    """For each call, the claimed item's graph with its stored values and the node's attempts, else what the
    claim found. The common claims go to the database together (one statement on PostgreSQL)."""
    now = utcnow()
    lease = now + timedelta(seconds=worker.policy.lease_s)
    requests = [
        ClaimRequest(c.job_id, c.item_id, c.node_id, c.token, c.redelivered, worker.policy.max_attempts, lease, now)
        for c in calls
    ]
    claims = worker.store.claim_many(requests)
    lap("claim")
    found = [_claimed(worker, call, claim) for call, claim in zip(calls, claims, strict=True)]
    lap("load")
    return found


def _claimed(worker: NodeWorker, call: NodeCall, claim: Claim) -> Outcome | tuple[ItemGraph, int]:
    if claim.item is None:
        return _REFUSED[claim.status]
    row = claim.item
    module = worker.module_for(call.job_id, row.pipeline_name, row.pipeline_id)
    graph = worker.graph_for(call.job_id, call.item_id, module, row.item_input)
    if call.node_id not in graph.nodes:
        _fail(worker, call, _pipeline_changed(call.node_id))
        return Outcome.FAILED
    values = {n: decode_value(v) for n, v in row.values.items() if n in graph.nodes}
    return ItemGraph(call.job_id, call.item_id, row.custom_id, graph, values), claim.attempts


def _pipeline_changed(node_id: str) -> dict[str, Any]:
    return {
        "type": "PipelineChanged",
        "message": f"the pipeline no longer has node {node_id}: it changed after the job was submitted; "
        "submit the job again",
    }


# -- 2. run --------------------------------------------------------------------------------------------------
async def _execute(worker: NodeWorker, item: ItemGraph, node_id: str, attempt: int) -> TaskResult:
    node = item.graph.nodes[node_id]
    resources = None
    if node.kind == "llm":
        aliases = sorted({n.alias for n in item.graph.nodes.values() if n.alias})
        resources = worker.resources_for(aliases)
    limited = 0
    while True:
        try:
            return await execute_node(item, node_id, resources, attempt)
        except RateLimitError:
            # the endpoint's limiter (shared by every worker) was slowed down and honours Retry-After: ask again
            limited += 1
            if limited > worker.policy.max_rate_limited:
                raise


def _retry_or_fail(
    worker: NodeWorker, call: NodeCall, item: ItemGraph, attempts: int, exc: Exception
) -> Outcome:
    node = item.graph.nodes[call.node_id]
    budget = worker.policy.max_attempts
    if node.kind == "llm" and node.alias:
        try:
            budget = min(budget, 1 + int(worker.resources_for([node.alias]).max_retries(node.alias)))
        except Exception:
            budget = min(budget, 1)
    else:
        budget = 1  # plain Python nodes are not retried (as in the in-process scheduler)
    if attempts >= budget:
        _fail(worker, call, _node_error(call.node_id, exc))
        return Outcome.FAILED
    delay = min(worker.policy.retry_delay_s * 2 ** (attempts - 1), MAX_RETRY_DELAY_S)
    deadline = utcnow() + timedelta(seconds=delay + worker.policy.stale_s)
    requeue = partial(worker.store.requeue, item_id=call.item_id, node_id=call.node_id, token=call.token)
    ref = retrying(worker, partial(requeue, deadline=deadline))
    if ref is not None:  # else it finished or was taken over meanwhile
        log.info("node %s failed transiently (%s); retrying in %.1f s", call.token, exc, delay)
        _send(worker, [message_of(ref, countdown=delay)])
    return Outcome.RETRY


def _node_error(node_id: str, exc: BaseException) -> dict[str, Any]:
    error = error_of(exc)
    error["node"] = node_id
    return error


def _fail(worker: NodeWorker, call: NodeCall, error: dict[str, Any]) -> None:
    fail = worker.store.fail
    retrying(
        worker, partial(fail, job_id=call.job_id, item_id=call.item_id, node_id=call.node_id, error=error)
    )


# -- sending -------------------------------------------------------------------------------------------------
def _refill(worker: NodeWorker) -> None:
    """Top the dispatch windows up (see :mod:`app.jobs.distributed.window`). A failure leaves the ready nodes
    queued in PostgreSQL for the next refill: the next delivery's, the API's loop or the sweeper's."""
    if worker.window is None:
        return
    try:
        worker.window.refill_soon()
    except Exception as exc:
        log.warning("could not refill the dispatch windows (%s); the next refill will", exc)


def _send(worker: NodeWorker, messages: Sequence[NodeMessage]) -> None:
    """Send after the commit. If the broker refuses, the nodes stay queued in PostgreSQL and the sweeper sends
    them once their deadline passes."""
    if not messages:
        return
    try:
        worker.dispatcher.send(messages)
    except Exception as exc:
        log.warning("could not send %d node task(s) (%s); the sweeper will send them", len(messages), exc)
