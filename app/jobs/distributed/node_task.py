"""One node of one item, run by a worker: the function behind the Celery node task.

``run_node(worker, call)``:

1. claims the node in PostgreSQL (one transaction): nothing to do if its result is stored, its job or item is
   closed, or another live delivery holds it; fails the item cleanly once the node was started
   ``max_attempts`` times; otherwise marks it running with a lease (renewed while it runs) and loads the item's
   stored node values;
2. runs it (an LLM call goes through the endpoint's global limits; a 429 is reported there and retried);
3. stores the result with ``INSERT ... ON CONFLICT DO NOTHING`` and, in the same transaction, counts down the
   waiting dependencies of its dependents (``UPDATE ... RETURNING``), runs the cheap ``F.*`` ops that became
   ready on the spot, and finishes the item (and the job) when nothing is left;
4. after the commit, sends the nodes that became ready.

Transient failures (a timeout, a 5xx, a dropped connection) are queued again with exponential backoff, within
the endpoint's ``max_retries`` and the attempts cap; other failures fail the item with the error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import partial
from typing import Any, TypeVar

import psycopg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.db import ITEM_OPEN, ItemStatus, JobStatus, repository, session_scope, utcnow
from app.db.direct import DirectPool
from app.db.models import NodeTaskStatus
from app.db.repository import node_runs as runs_repo
from app.db.repository import node_tasks as tasks_repo
from app.db.repository.node_tasks import NodeTaskRef
from app.jobs.distributed.messages import Dispatcher, NodeMessage
from app.jobs.distributed.settle import fail_item, finish_item_if_done, item_metrics, settle_job
from app.jobs.encoding import decode_item_input, decode_value, encode_value, error_of
from app.jobs.graphs import load_module, trace_item
from app.jobs.nodes import ItemGraph, execute_node, item_outcome
from app.jobs.writer import CostFn, endpoint_cost
from app.pipeline.execution.node_runner import is_inline, resolve_args
from app.pipeline.execution.state import TaskResult
from app.pipeline.graph import InferenceGraph, OpNode
from app.pipeline.resources.errors import RateLimitError, TransientError
from app.pipeline.values import Value, first_error_value

log = logging.getLogger(__name__)

T = TypeVar("T")
OPEN_JOB = (JobStatus.QUEUED, JobStatus.RUNNING)
MAX_RETRY_DELAY_S = 60.0
GRAPH_CACHE_ITEMS = 2048  # traced graphs of recent items kept per worker process


class Outcome(StrEnum):
    """What one delivery of a node task did."""

    STORED = "stored"  # ran, stored its result, sent the nodes that became ready
    ALREADY_DONE = "already_done"  # a re-delivered or duplicate task: the result was stored before
    BUSY = "busy"  # another live delivery runs it
    CLOSED = "closed"  # its job or item is no longer open (cancelled, failed, expired)
    NOT_READY = "not_ready"  # its dependencies are not stored yet (a stray message)
    RETRY = "retry"  # a transient failure: queued again with a countdown
    FAILED = "failed"  # the item failed (the node's error, or the attempts cap)


@dataclass(frozen=True)
class NodePolicy:
    """Leases, attempts and backoff of node tasks (from Settings)."""

    lease_s: float = 60.0  # a running node's lease; renewed every third of it while the node runs
    max_attempts: int = 5  # deliveries that may start a node before its item fails
    retry_delay_s: float = 1.0  # first backoff of a transient failure, doubled per attempt
    stale_s: float = 30.0  # a queued node whose message was not taken this long after it was due is re-sent
    max_rate_limited: int = 8  # 429s one delivery retries in place (the global limiter paces them)
    db_retry_s: float = 120.0  # how long storing a result retries while the database is unreachable
    # a queued node overdue this long is sent again even while its queue has a backlog (a lost message must
    # not wait for the queue to drain; a duplicate only finds the node running or done)
    resend_after_s: float = 3600.0


@dataclass(frozen=True)
class NodeCall:
    """One delivery of a node task. ``token`` is the task id; ``redelivered`` says the broker gave this very
    message again (its worker died, or Celery retries it), so it may take over its own earlier claim."""

    job_id: str
    item_id: int
    node_id: str
    attempt: int
    token: str
    redelivered: bool = False


@dataclass
class NodeWorker:
    """What one worker process needs to run node tasks.

    ``resources_for(aliases)``: the endpoints (a ResourceManager); ``submit(coro)``: schedules a coroutine on
    the process's event loop from a task thread and returns its ``concurrent.futures.Future``; ``observe``:
    optional hooks for metrics (node seconds by kind).
    """

    sessions: sessionmaker[Session]
    dispatcher: Dispatcher
    resources_for: Callable[[list[str]], Any]
    submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future[Any]]
    policy: NodePolicy = field(default_factory=NodePolicy)
    observe: Callable[[str, float], None] | None = None
    # raw autocommit connections on PostgreSQL: the common claim and store are then one statement each
    direct: DirectPool | None = None
    _modules: dict[str, Any] = field(default_factory=dict)
    _modules_lock: threading.Lock = field(default_factory=threading.Lock)
    _graphs: OrderedDict[tuple[str, int], InferenceGraph] = field(default_factory=OrderedDict)
    _graphs_lock: threading.Lock = field(default_factory=threading.Lock)

    def graph_for(self, job_id: str, item_id: int, module: Any, item_input: Any) -> InferenceGraph:
        """The item's traced graph. Its nodes usually run one after another in the same worker, so the recent
        items' graphs are kept (tracing costs about as much as a database round trip)."""
        key = (job_id, item_id)
        with self._graphs_lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                return graph
        args, kwargs = decode_item_input(item_input)
        graph = trace_item(module, args, kwargs)
        with self._graphs_lock:
            self._graphs[key] = graph
            if len(self._graphs) > GRAPH_CACHE_ITEMS:
                self._graphs.popitem(last=False)
        return graph

    def module_for(
        self, job_id: str, pipeline_name: str, pipeline_id: int, session: Session | None = None
    ) -> Any:
        """The job's pipeline, loaded once per process and job (with the parameters registered at that time)."""
        with self._modules_lock:
            module = self._modules.get(job_id)
            if module is None:
                if session is None:
                    with session_scope(self.sessions) as own:
                        state = _parameter_state(own, pipeline_id)
                else:
                    state = _parameter_state(session, pipeline_id)
                module = load_module(pipeline_name, state)
                if len(self._modules) >= 64:  # a long-lived worker sees many jobs: keep the recent ones
                    self._modules.pop(next(iter(self._modules)))
                self._modules[job_id] = module
            return module


def _parameter_state(session: Session, pipeline_id: int) -> dict[str, Any]:
    pipeline = repository.get_pipeline(session, pipeline_id=pipeline_id)
    return dict(pipeline.parameter_state or {}) if pipeline is not None else {}


@dataclass
class _Claim:
    outcome: Outcome | None  # None: run it
    attempts: int = 0
    item: ItemGraph | None = None


def run_node(worker: NodeWorker, call: NodeCall) -> Outcome:
    """Claim, run and store one node, then send the nodes that became ready (see the module docstring)."""
    claim = _claim(worker, call)
    if claim.outcome is not None:
        return claim.outcome
    item = claim.item
    assert item is not None
    node = item.graph.nodes[call.node_id]
    start = time.perf_counter()
    try:
        result = _leased(worker, call, worker.submit(_execute(worker, item, call.node_id, claim.attempts)))
    except TransientError as exc:
        return _retry_or_fail(worker, call, item, claim.attempts, exc)
    except Exception as exc:  # the node's own error: the item fails with it (errors are data)
        _in_transaction(worker, partial(_fail, call, _node_error(call.node_id, exc)))
        return Outcome.FAILED
    if worker.observe is not None:
        worker.observe(node.kind, time.perf_counter() - start)
    ready = _store(worker, item, result)
    _send(worker, [_message(ref) for ref in ready])
    return Outcome.STORED


# -- 1. claim -------------------------------------------------------------------------------------------------
def _claim(worker: NodeWorker, call: NodeCall) -> _Claim:
    if worker.direct is not None:
        claim = _claim_fast(worker, call)
        if claim is not None:
            return claim
    policy = worker.policy
    with session_scope(worker.sessions) as session:
        now = utcnow()
        quick = runs_repo.claim_queued(
            session,
            item_id=call.item_id,
            node_id=call.node_id,
            token=call.token,
            max_attempts=policy.max_attempts,
            deadline=now + timedelta(seconds=policy.lease_s),
            now=now,
        )
        if quick is not None:  # the common case, in one statement
            return _claimed(worker, session, call, quick, quick.attempts, now)
        row = runs_repo.read_claim(session, item_id=call.item_id, node_id=call.node_id)
        if row is None:
            return _Claim(Outcome.CLOSED)  # the job was deleted
        if row.status == NodeTaskStatus.DONE:
            return _Claim(Outcome.ALREADY_DONE)
        if row.status == NodeTaskStatus.FAILED:
            return _Claim(Outcome.CLOSED)
        if row.status == NodeTaskStatus.WAITING:
            return _Claim(Outcome.NOT_READY)
        if row.job_status not in OPEN_JOB or row.item_status not in ITEM_OPEN:
            tasks_repo.set_node_task_status(
                session, item_id=call.item_id, node_ids=[call.node_id], status=NodeTaskStatus.FAILED
            )
            settle_job(session, call.job_id)
            return _Claim(Outcome.CLOSED)
        now = utcnow()
        live = (
            row.status == NodeTaskStatus.RUNNING and row.deadline is not None and _aware(row.deadline) > now
        )
        # another delivery runs it; only a re-delivery of this very task (its worker died) takes over
        if live and not (call.redelivered and row.claimed_by == call.token):
            return _Claim(Outcome.BUSY)
        if row.attempts >= policy.max_attempts:
            fail_item(
                session,
                call.job_id,
                call.item_id,
                {
                    "type": "TooManyAttempts",
                    "message": f"node {call.node_id} was started {row.attempts} times without finishing (its worker "
                    "stopped each time); raise INF_ENGINE_NODE_MAX_ATTEMPTS to allow more",
                },
            )
            return _Claim(Outcome.FAILED)
        attempts = runs_repo.start_claim(
            session,
            row_id=row.row_id,
            token=call.token,
            deadline=now + timedelta(seconds=policy.lease_s),
            now=now,
        )
        return _claimed(worker, session, call, row, attempts, now)


def _claim_fast(worker: NodeWorker, call: NodeCall) -> _Claim | None:
    """The common claim (a queued node of an open job) in one autocommit statement; None otherwise."""
    assert worker.direct is not None
    now = utcnow()
    with worker.direct.connection() as conn:
        claimed = runs_repo.claim_one(
            conn,
            item_id=call.item_id,
            node_id=call.node_id,
            token=call.token,
            max_attempts=worker.policy.max_attempts,
            deadline=now + timedelta(seconds=worker.policy.lease_s),
            now=now,
        )
        if claimed is None:
            return None
    row, stored = claimed
    module = worker.module_for(call.job_id, row.pipeline_name, row.pipeline_id)
    graph = worker.graph_for(call.job_id, call.item_id, module, row.item_input)
    if call.node_id not in graph.nodes:
        _in_transaction(worker, partial(_fail, call, _pipeline_changed(call.node_id)))
        return _Claim(Outcome.FAILED)
    values = {n: decode_value(v) for n, v in stored.items() if n in graph.nodes}
    return _Claim(None, row.attempts, ItemGraph(call.job_id, call.item_id, row.custom_id, graph, values))


def _pipeline_changed(node_id: str) -> dict[str, Any]:
    return {
        "type": "PipelineChanged",
        "message": f"the pipeline no longer has node {node_id}: it changed after the job was submitted; "
        "submit the job again",
    }


def _claimed(
    worker: NodeWorker,
    session: Session,
    call: NodeCall,
    row: runs_repo.ClaimRow | runs_repo.QuickClaim,
    attempts: int,
    now: datetime,
) -> _Claim:
    """The node is ours: trace its item and read the stored values it needs (in the claim's transaction)."""
    if row.item_status == ItemStatus.PENDING:
        runs_repo.mark_item_running(session, item_id=call.item_id, now=now)
    module = worker.module_for(call.job_id, row.pipeline_name, row.pipeline_id, session)
    graph = worker.graph_for(call.job_id, call.item_id, module, row.item_input)
    node = graph.nodes.get(call.node_id)
    if node is None:
        _fail(call, _pipeline_changed(call.node_id), session)
        return _Claim(Outcome.FAILED)
    # a first node reads the item's inputs only: no stored values to ask for
    inputs = set(graph.input_ids)
    stored = {}
    if any(dep not in inputs for dep in node.dependencies):
        stored = runs_repo.item_values(session, item_id=call.item_id)
    values = {n: decode_value(v) for n, v in stored.items() if n in graph.nodes}
    return _Claim(None, attempts, ItemGraph(call.job_id, call.item_id, row.custom_id, graph, values))


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)  # SQLite hands back naive UTC


# -- 2. run -----------------------------------------------------------------------------------------------------
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


def _leased(worker: NodeWorker, call: NodeCall, future: concurrent.futures.Future[T]) -> T:
    """Wait for the node's coroutine while renewing its lease every third of it (from this task thread, so the
    event loop does no bookkeeping for it), so the sweeper leaves a live node alone."""
    period = worker.policy.lease_s / 3
    while True:
        try:
            return future.result(timeout=period)
        except concurrent.futures.TimeoutError:
            try:
                _renew(worker, call)
            except Exception as exc:  # the database is away: the lease may lapse, and a re-run is harmless
                log.warning("cannot renew the lease of %s: %s", call.token, exc)


def _renew(worker: NodeWorker, call: NodeCall) -> None:
    with session_scope(worker.sessions) as session:
        deadline = utcnow() + timedelta(seconds=worker.policy.lease_s)
        tasks_repo.renew_node_lease(
            session, item_id=call.item_id, node_id=call.node_id, token=call.token, deadline=deadline
        )


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
        _in_transaction(worker, partial(_fail, call, _node_error(call.node_id, exc)))
        return Outcome.FAILED
    delay = min(worker.policy.retry_delay_s * 2 ** (attempts - 1), MAX_RETRY_DELAY_S)
    ref = _in_transaction(worker, partial(_requeue_after_error, worker, call, delay))
    if ref is not None:
        log.info("node %s failed transiently (%s); retrying in %.1f s", call.token, exc, delay)
        _send(worker, [_message(ref, countdown=delay)])
    return Outcome.RETRY


def _requeue_after_error(
    worker: NodeWorker, call: NodeCall, delay: float, session: Session
) -> NodeTaskRef | None:
    row = tasks_repo.lock_node_task(session, item_id=call.item_id, node_id=call.node_id)
    if row is None or row.status != NodeTaskStatus.RUNNING or row.claimed_by != call.token:
        return None  # finished or taken over meanwhile
    deadline = utcnow() + timedelta(seconds=delay + worker.policy.stale_s)
    return tasks_repo.requeue_node_task(
        session, row_id=row.id, expect_status=NodeTaskStatus.RUNNING, deadline=deadline
    )


def _node_error(node_id: str, exc: BaseException) -> dict[str, Any]:
    error = error_of(exc)
    error["node"] = node_id
    return error


def _fail(call: NodeCall, error: dict[str, Any], session: Session) -> None:
    tasks_repo.set_node_task_status(
        session, item_id=call.item_id, node_ids=[call.node_id], status=NodeTaskStatus.FAILED
    )
    fail_item(session, call.job_id, call.item_id, error)


# -- 3. store ---------------------------------------------------------------------------------------------------
def _store(worker: NodeWorker, item: ItemGraph, result: TaskResult) -> list[NodeTaskRef]:
    """Store the result, count down the dependents, run ready inline ops, finish the item when it is done.
    Returns the nodes to send (none when the job stopped meanwhile: releasing checks that it is open)."""
    if worker.direct is not None and _leads_everything(item, result.node_id):
        # the node every other node leads to: its result and the item's outcome in one statement
        return _in_transaction(worker, partial(_store_last, worker, item, result), True)
    if worker.direct is None or not item.graph.dependents().get(result.node_id):
        # an item's last node is one without dependents: its result and the item's outcome commit together
        return _in_transaction(worker, partial(_store_in, worker, item, result, True))
    # PostgreSQL: each node's store is one autocommit statement; the item's completion is one transaction
    seen: dict[str, str | None] = {}
    store = partial(_store_one, seen)
    reached_sink, to_send = _in_transaction(worker, partial(_store_chain, worker, item, result, store), True)
    if reached_sink:
        _in_transaction(worker, partial(_finish, worker, item))
    if seen.get("job") == JobStatus.CANCELLING:
        _in_transaction(worker, partial(_settle, item.job_id))  # this may have been its last running node
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


def _store_last(
    worker: NodeWorker, item: ItemGraph, result: TaskResult, conn: psycopg.Connection
) -> list[NodeTaskRef]:
    item.values[result.node_id] = result.value
    outcome = item_outcome(item)
    assert outcome is not None  # _leads_everything checked that every output is known
    now = utcnow()
    inserted, progress = runs_repo.store_last(
        conn,
        job_id=item.job_id,
        item_id=item.item_id,
        node_id=result.node_id,
        value=encode_value(result.value),
        duration_ms=round(result.duration_ms, 3),
        attempt=result.retry_count,
        status=outcome.status,
        output=outcome.output,
        error=outcome.error,
        metrics=item_metrics(item, _cost(worker, item)),
        now=now,
    )
    if inserted and (progress is None or progress.finished):
        # the job may be due (its last item), or the item was closed meanwhile (a cancel may be due)
        with session_scope(worker.sessions) as tx:
            settle_job(tx, item.job_id)
    return []


def _store_in(
    worker: NodeWorker, item: ItemGraph, result: TaskResult, finish: bool, session: Session
) -> list[NodeTaskRef]:
    reached_sink, to_send = _store_chain(worker, item, result, _store_two, session)
    if reached_sink and finish:
        _finish(worker, item, session)
    if runs_repo.job_status(session, job_id=item.job_id) == JobStatus.CANCELLING:
        settle_job(session, item.job_id)  # this may have been its last running node
    return to_send


# (a session, or a raw connection for _store_one), the item, a result, its dependents, their deadline, now
StoreOne = Callable[[Any, ItemGraph, TaskResult, list[str], Any, Any], tuple[bool, list[NodeTaskRef]]]


def _store_two(
    session: Session, item: ItemGraph, current: TaskResult, waiting: list[str], deadline: Any, now: Any
) -> tuple[bool, list[NodeTaskRef]]:
    inserted = runs_repo.store_result(
        session,
        job_id=item.job_id,
        item_id=item.item_id,
        node_id=current.node_id,
        value=encode_value(current.value),
        duration_ms=round(current.duration_ms, 3),
        attempt=current.retry_count,
        now=now,
    )
    if not inserted or not waiting:
        return inserted, []
    ready = runs_repo.release(
        session, job_id=item.job_id, item_id=item.item_id, node_ids=waiting, deadline=deadline, now=now
    )
    return True, ready


def _store_one(
    seen: dict[str, str | None],
    conn: psycopg.Connection,
    item: ItemGraph,
    current: TaskResult,
    waiting: list[str],
    deadline: Any,
    now: Any,
) -> tuple[bool, list[NodeTaskRef]]:
    inserted, ready, seen["job"] = runs_repo.store_one(
        conn,
        job_id=item.job_id,
        item_id=item.item_id,
        node_id=current.node_id,
        value=encode_value(current.value),
        duration_ms=round(current.duration_ms, 3),
        attempt=current.retry_count,
        dependents=waiting,
        deadline=deadline,
        now=now,
    )
    return inserted, ready


def _store_chain(
    worker: NodeWorker, item: ItemGraph, result: TaskResult, store: StoreOne, db: Session | psycopg.Connection
) -> tuple[bool, list[NodeTaskRef]]:
    """Store ``result`` and the inline ops it makes ready; (an item's sink was stored, the nodes to send)."""
    now = utcnow()
    deadline = now + timedelta(seconds=worker.policy.stale_s)
    dependents = item.graph.dependents()
    to_send: list[NodeTaskRef] = []
    pending = [result]
    first = True
    reached_sink = False
    while pending:
        current = pending.pop()
        waiting = sorted(set(dependents.get(current.node_id, [])))
        inserted, ready = store(db, item, current, waiting, deadline, now)
        if not inserted:
            if first:
                return False, []  # another delivery stored it first, and released its dependents then
            continue
        first = False
        item.values[current.node_id] = current.value
        if not waiting:
            reached_sink = True  # only a node without dependents can be an item's last one
            continue
        inline = [r for r in ready if is_inline(item.graph.nodes[r.node_id])]
        if inline:
            # their other inputs may have been stored by other workers: read them now
            if isinstance(db, Session):
                stored = runs_repo.item_values(db, item_id=item.item_id)
            else:
                stored = runs_repo.item_values_direct(db, item_id=item.item_id)
            item.values.update(
                {
                    n: decode_value(v)
                    for n, v in stored.items()
                    if n in item.graph.nodes and n not in item.values
                }
            )
            pending.extend(_run_inline(item, r.node_id) for r in inline)
        to_send.extend(r for r in ready if r not in inline)
    return reached_sink, to_send


def _finish(worker: NodeWorker, item: ItemGraph, session: Session) -> None:
    finish_item_if_done(session, item, _cost(worker, item))


def _settle(job_id: str, session: Session) -> None:
    settle_job(session, job_id)


def _cost(worker: NodeWorker, item: ItemGraph) -> CostFn | None:
    aliases = sorted({n.alias for n in item.graph.nodes.values() if n.kind == "llm" and n.alias})
    if not aliases:
        return None
    return partial(endpoint_cost, worker.resources_for(aliases))


def _run_inline(item: ItemGraph, node_id: str) -> TaskResult:
    """An ``F.*`` op, run in the task that made it ready: a message round trip would cost more than the op."""
    node = item.graph.nodes[node_id]
    assert isinstance(node.module, OpNode)
    start = time.perf_counter()
    args, kwargs = resolve_args(item.state(), node)
    failed = first_error_value(*args, **kwargs)
    value = failed if failed is not None else node.module.run(args, kwargs)
    if value.ref != node_id:
        value = Value(value.kind, value.payload, node_id, dict(value.meta))
    return TaskResult(node_id, value, (time.perf_counter() - start) * 1000.0, 0)


# -- transactions and sending ---------------------------------------------------------------------------------
def _in_transaction(worker: NodeWorker, work: Callable[[Any], T], fast: bool = False) -> T:
    """Run ``work`` in one transaction (``fast``: on a raw autocommit connection, each statement its own, when
    the worker has them), retrying while the database is unreachable (a restart, a failover): the node's result
    is kept in memory meanwhile instead of calling the endpoint again."""
    deadline = time.monotonic() + worker.policy.db_retry_s
    delay = 0.2
    while True:
        try:
            if fast and worker.direct is not None:
                with worker.direct.connection() as conn:
                    return work(conn)
            with session_scope(worker.sessions) as session:
                return work(session)
        except DBAPIError as exc:
            unreachable = exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError)
            if not unreachable or time.monotonic() + delay > deadline:
                raise
            log.warning("database unavailable (%s); retrying in %.1f s", str(exc.orig).strip(), delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _send(worker: NodeWorker, messages: Sequence[NodeMessage]) -> None:
    """Send after the commit. If the broker refuses, the nodes stay queued in PostgreSQL and the sweeper sends
    them once their deadline passes."""
    if not messages:
        return
    try:
        worker.dispatcher.send(messages)
    except Exception as exc:
        log.warning("could not send %d node task(s) (%s); the sweeper will send them", len(messages), exc)


def _message(ref: NodeTaskRef, countdown: float = 0.0) -> NodeMessage:
    return NodeMessage(ref.job_id, ref.item_id, ref.node_id, ref.attempts, ref.queue, ref.priority, countdown)


def message_of(ref: NodeTaskRef, countdown: float = 0.0) -> NodeMessage:
    """The message that sends ``ref`` (its attempt number is the attempts started so far)."""
    return _message(ref, countdown)
