"""What a worker process needs to run node tasks: its policy (leases, attempts, backoff), one delivery's
identity, and the worker's node store, endpoints and caches of loaded pipelines and traced item graphs."""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repository, session_scope
from app.db.direct import DirectPool
from app.db.repository.node_store import NodeStore, open_node_store
from app.jobs.distributed.messages import Dispatcher
from app.jobs.distributed.settle import settle_job
from app.jobs.distributed.window import DispatchWindow
from app.jobs.encoding import decode_item_input
from app.jobs.graphs import ShapeGraphs, load_module
from app.pipeline.graph import InferenceGraph

GRAPH_CACHE_ITEMS = 2048  # traced graphs of recent items kept per worker process
MODULE_CACHE_JOBS = 64  # loaded pipelines of recent jobs kept per worker process


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
    # rounds of dependents one delivery runs on the spot when they become ready on its own queue (0: send each)
    local_chain: int = 4


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
    optional hooks for metrics (node seconds by kind); ``max_calls``: node calls this process runs at once (0: no
    cap; a message's nodes run together, so the threads alone no longer bound them); ``direct``: raw autocommit
    connections on PostgreSQL,
    on which the node store runs the common claim and store as one statement each; ``group_commit``: the task
    threads' claims and stores on ``direct`` share transactions (``settings.node_store_group_commit``).
    ``store``: the node store (built from ``sessions`` and ``direct``); ``window``: refills the dispatch windows
    when a delivery ends.
    """

    sessions: sessionmaker[Session]
    dispatcher: Dispatcher
    resources_for: Callable[[list[str]], Any]
    submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future[Any]]
    policy: NodePolicy = field(default_factory=NodePolicy)
    observe: Callable[[str, float], None] | None = None
    max_calls: int = 0
    direct: DirectPool | None = None
    group_commit: bool = True
    window: DispatchWindow | None = None  # the fair, bounded dispatcher (default: fixed windows, no quotas)
    store: NodeStore = field(init=False)
    _modules: dict[str, Any] = field(default_factory=dict)
    _modules_lock: threading.Lock = field(default_factory=threading.Lock)
    _graphs: OrderedDict[tuple[str, int], InferenceGraph] = field(default_factory=OrderedDict)
    _graphs_lock: threading.Lock = field(default_factory=threading.Lock)
    _shapes: ShapeGraphs = field(default_factory=ShapeGraphs)

    def __post_init__(self) -> None:
        self.store = open_node_store(self.sessions, settle_job, self.direct, group_commit=self.group_commit)
        if self.window is None:
            self.window = DispatchWindow.fixed(self.sessions, self.dispatcher, self.policy.stale_s)
        self._call_slots = threading.BoundedSemaphore(self.max_calls) if self.max_calls > 0 else None

    def take_call_slots(self, wanted: int) -> int:
        """Up to ``wanted`` call slots for a task thread: waits for one while ``max_calls`` node calls run, then
        takes the free ones without waiting (so a thread never holds a slot it is not about to use); returns how
        many. Taken before the claims, so a node is claimed only when its call can start: a cancelled job's
        claimed nodes are the few already calling."""
        slots = self._call_slots
        if slots is None:
            return wanted
        slots.acquire()
        taken = 1
        while taken < wanted and slots.acquire(blocking=False):
            taken += 1
        return taken

    def give_call_slots(self, count: int) -> None:
        if self._call_slots is not None:
            for _ in range(count):
                self._call_slots.release()

    def graph_for(self, job_id: str, item_id: int, module: Any, item_input: Any) -> InferenceGraph:
        """The item's traced graph. Its nodes usually run one after another in the same worker, so the recent
        items' graphs are kept; a new item's is its shape's graph with its inputs bound (see
        :class:`~app.jobs.graphs.ShapeGraphs`: tracing costs about as much as a database round trip)."""
        key = (job_id, item_id)
        with self._graphs_lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                return graph
        args, kwargs = decode_item_input(item_input)
        graph = self._shapes.graph(job_id, module, args, kwargs)
        with self._graphs_lock:
            self._graphs[key] = graph
            if len(self._graphs) > GRAPH_CACHE_ITEMS:
                self._graphs.popitem(last=False)
        return graph

    def module_for(self, job_id: str, pipeline_name: str, pipeline_id: int) -> Any:
        """The job's pipeline, loaded once per process and job (with the parameters registered at that time)."""
        with self._modules_lock:
            module = self._modules.get(job_id)
            if module is None:
                with session_scope(self.sessions) as session:
                    pipeline = repository.get_pipeline(session, pipeline_id=pipeline_id)
                    state = dict(pipeline.parameter_state or {}) if pipeline is not None else {}
                module = load_module(pipeline_name, state)
                if (
                    len(self._modules) >= MODULE_CACHE_JOBS
                ):  # a long-lived worker sees many jobs: keep the recent
                    self._modules.pop(next(iter(self._modules)))
                self._modules[job_id] = module
            return module
