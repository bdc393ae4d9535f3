"""Bounded, fair dispatch: the broker holds only a window of ready node tasks per queue; PostgreSQL holds the rest.

A ready node (status ``queued``) is either sent (``sent_at`` set: its message is in the broker or with a worker
that has not claimed it yet) or not yet. :meth:`DispatchWindow.refill` tops each queue's sent-and-unclaimed
nodes up to the queue's window, choosing whose nodes go by :mod:`app.jobs.limits.fairness` (lower job priority first,
then a fair share between tenants, then between a tenant's jobs) and sends them after its commit. Whoever frees
capacity refills: the dispatch of a new job, every node task when it ends, the sweeper, and the API's loop. One
refill runs at a time (a PostgreSQL advisory lock); a refill that finds the lock taken leaves the work to the
one running, and the next delivery or tick catches up.

Redis therefore never holds more than the windows (plus retries with a countdown, which replace a running node),
a 50,000-item job does not bury a 10-item job behind it, and cancelling a job leaves at most a window of stale
messages, each acknowledged without running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope, utcnow
from app.db.models import NodeTaskStatus
from app.db.repository import window as window_repo
from app.db.repository.node_tasks import NodeTaskRef
from app.jobs.distributed.messages import Dispatcher, NodeMessage, messages_of
from app.jobs.limits.fairness import Demand, allocate

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 64  # a queue's window when no worker has announced its capacity (and none is set)
MIN_WINDOW = 8
# A job's nodes taken together from at least this many items share messages (``group`` a message): grouping runs
# them one after another on one worker, a good trade when many items keep every slot busy (a message costs a
# worker more than a node's bookkeeping) and a bad one when few items' own parallelism is all there is.
GROUP_MIN_ITEMS = 16
HAND_OUT = 1000  # slots one round of a refill hands out (a larger window takes several rounds)
CAPACITY_CACHE_S = 5.0  # how long the workers' announced capacity is trusted before it is read again

#: queue -> the task slots of the workers consuming it (None: nobody announced)
Capacity = Callable[[str], int | None]


@dataclass(frozen=True)
class WindowPolicy:
    """How large each queue's window is and how it is shared (from Settings).

    ``window``: node tasks sent and not claimed yet per queue (0: the task slots of the workers consuming it, at
    least ``MIN_WINDOW``, within ``caps``); ``caps``: per-queue upper bounds of that sizing (an endpoint's concurrency: more messages than calls
    can run only make a later job wait behind them); ``weights``: tenant -> share weight (1 by default);
    ``tenant_quota``: tenant -> node tasks it may hold in flight on all queues (0: no quota)."""

    window: int = 0
    caps: Mapping[str, int] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    tenant_quota: Callable[[str], int] = lambda tenant: 0
    stale_s: float = 30.0
    group: int = 1  # ready nodes of one job and queue that one message may carry


class DispatchWindow:
    """Refills the dispatch windows of ``dispatcher``'s queues from PostgreSQL (see the module docstring)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        dispatcher: Dispatcher,
        policy: WindowPolicy | None = None,
        *,
        capacity: Capacity | None = None,
        coalesce_s: float = 0.0,
    ) -> None:
        self.sessions = sessions
        self.dispatcher = dispatcher
        self.policy = policy or WindowPolicy()
        self.coalesce_s = coalesce_s
        self._capacity = capacity
        self._sizes: dict[str, int] = {}
        self._sized_at = float("-inf")
        self._due = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._closed = False

    @classmethod
    def fixed(cls, sessions: sessionmaker[Session], dispatcher: Dispatcher, stale_s: float) -> DispatchWindow:
        """Windows of ``DEFAULT_WINDOW`` per queue, no quotas, refilled inline: for callers not given the
        process's windows (tests, a sweep or dispatch run by hand)."""
        return cls(sessions, dispatcher, WindowPolicy(stale_s=stale_s, group=getattr(dispatcher, "group", 1)))

    @property
    def queues(self) -> Sequence[str]:
        return tuple(self.dispatcher.queues.all())

    def size(self, queue: str) -> int:
        """The queue's window: the setting, else the consumers' task slots (read at most every few seconds)."""
        if self.policy.window > 0:
            return self.policy.window  # the operator's choice overrides the sizing and the caps
        now = time.monotonic()
        if now - self._sized_at > CAPACITY_CACHE_S:
            self._sizes = {q: self._announced(q) for q in self.queues}
            self._sized_at = now
        size = self._sizes.get(queue, DEFAULT_WINDOW)
        cap = self.policy.caps.get(queue)
        return max(1, min(size, cap)) if cap else size

    def _announced(self, queue: str) -> int:
        if self._capacity is None:
            return DEFAULT_WINDOW
        try:
            slots = self._capacity(queue)
        except Exception as exc:  # Redis away: keep dispatching with the default
            log.warning("cannot read the workers' capacity (%s); dispatch window %d", exc, DEFAULT_WINDOW)
            return DEFAULT_WINDOW
        return DEFAULT_WINDOW if not slots else max(MIN_WINDOW, slots)

    def refill_soon(self) -> None:
        """Refill now, or (with ``coalesce_s``) on this process's refiller thread: at once when it has been idle
        for ``coalesce_s``, else at the end of that interval, so the deliveries that end meanwhile share one
        refill (the broker gets fewer, fuller messages) and a task thread never waits for PostgreSQL."""
        if self.coalesce_s <= 0:
            self.refill()
            return
        self._due.set()
        if self._thread is None or not self._thread.is_alive():
            with self._thread_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._refiller, name="dispatch-window", daemon=True)
                    self._thread.start()

    def close(self) -> None:
        """Stop the refiller thread, after the refill it may be running (a process that stops dispatching; refills
        asked for later run inline)."""
        self._closed = True
        self.coalesce_s = 0.0
        self._due.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _refiller(self) -> None:
        last = float("-inf")
        while True:
            self._due.wait()
            if self._closed:
                return
            # at once after a quiet spell (a lone delivery's dependents wait for nothing), else at most one refill
            # every coalesce_s: under load the deliveries ending meanwhile share it
            wait = last + self.coalesce_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self._closed:
                return
            self._due.clear()
            last = time.monotonic()
            try:
                if self.refill() < 0:
                    self._due.set()  # another process refills: look again after it
            except Exception as exc:  # the database is away: the next delivery asks again
                log.warning("could not refill the dispatch windows (%s); retrying", exc)

    def refill(self) -> int:
        """Send what the windows have room for; returns the node tasks sent, -1 when another refill runs."""
        backlog: set[str] = set()
        with session_scope(self.sessions) as session:
            refs = self._take(session, backlog)
        if not refs:
            return 0 if refs is not None else -1
        messages = _messages(refs, self.policy.group, backlog)
        try:
            self.dispatcher.send(messages)
        except Exception as exc:  # marked sent: the sweeper sends them again once their deadline passes
            log.warning("could not send %d node tasks (%s); the sweeper will", len(refs), exc)
        return len(refs)

    def _take(self, session: Session, backlog: set[str]) -> list[NodeTaskRef] | None:
        """The nodes to send (marked sent); None when another refill holds the lock. Jobs that have more
        unsent nodes than they got are added to ``backlog``."""
        if not window_repo.try_lock_dispatch(session):
            return None
        jobs = window_repo.open_jobs(session)
        if not jobs:
            return []
        flight = window_repo.in_flight(session)
        tenant_of = {j.id: j.tenant for j in jobs}
        room = self._tenant_room(jobs, flight)
        now = utcnow()
        deadline = now + timedelta(seconds=self.policy.stale_s)
        taken: list[NodeTaskRef] = []
        for queue in self.queues:
            waiting = sum(n for (q, _, status), n in flight.items() if q == queue and status == NodeTaskStatus.QUEUED)
            free = self.size(queue) - waiting
            if free <= 0:
                continue
            held: dict[str, int] = {}
            for (q, job_id, _), n in flight.items():
                if q == queue:
                    held[job_id] = held.get(job_id, 0) + n
            demands = [
                Demand(j.id, j.tenant, j.priority, held.get(j.id, 0), None, j.created_at.timestamp()) for j in jobs
            ]
            got = self._fill(session, queue, free, demands, room, now, deadline, backlog)
            for ref in got:
                tenant = tenant_of.get(ref.job_id)
                if tenant in room:
                    room[tenant] -= 1
            taken.extend(got)
        return taken

    def _tenant_room(
        self, jobs: Sequence[window_repo.OpenJob], flight: Mapping[tuple[str, str, str], int]
    ) -> dict[str, int]:
        """How many more node tasks each tenant with a quota may put in flight."""
        held: dict[str, int] = {}
        tenant_of = {j.id: j.tenant for j in jobs}
        for (_, job_id, _), n in flight.items():
            tenant = tenant_of.get(job_id)
            if tenant is not None:
                held[tenant] = held.get(tenant, 0) + n
        room: dict[str, int] = {}
        for tenant in {j.tenant for j in jobs}:
            quota = self.policy.tenant_quota(tenant)
            if quota > 0:
                room[tenant] = max(0, quota - held.get(tenant, 0))
        return room

    def _fill(
        self,
        session: Session,
        queue: str,
        free: int,
        demands: list[Demand],
        room: dict[str, int],
        now: datetime,
        deadline: datetime,
        backlog: set[str],
    ) -> list[NodeTaskRef]:
        """Hand ``free`` slots out fairly, taking each job's share of its unsent nodes; a job that has fewer than
        its share drops out and the rest is handed out again (at most one round per job)."""
        taken: list[NodeTaskRef] = []
        room = dict(room)
        while free > 0 and demands:
            # slots are handed out one at a time: a round of at most HAND_OUT keeps that cheap for any window
            grants = allocate(min(free, HAND_OUT), demands, weights=self.policy.weights, tenant_room=room)
            if not grants:
                break
            for job_id, n in grants.items():
                got = window_repo.take_unsent(
                    session, job_id=job_id, queue=queue, limit=n, now=now, deadline=deadline
                )
                taken.extend(got)
                free -= len(got)
                index = next(i for i, d in enumerate(demands) if d.job_id == job_id)
                demand = demands[index]
                if demand.tenant in room:
                    room[demand.tenant] -= len(got)
                if len(got) < n:
                    demands.pop(index)  # nothing more of this job on this queue now
                    backlog.discard(job_id)
                else:
                    backlog.add(job_id)
                    demands[index] = replace(demand, in_flight=demand.in_flight + len(got))
        return taken


def _messages(refs: Sequence[NodeTaskRef], group: int, backlog: set[str]) -> list[NodeMessage]:
    """One message a node, except for a job with nodes of many items in this refill (see ``GROUP_MIN_ITEMS``) or
    more ready nodes than it got (a backlog: its parallelism is not what it lacks)."""
    by_job: dict[str, list[NodeTaskRef]] = {}
    for ref in refs:
        by_job.setdefault(ref.job_id, []).append(ref)
    messages: list[NodeMessage] = []
    for job_id, job_refs in by_job.items():
        many = job_id in backlog or len({r.item_id for r in job_refs}) >= GROUP_MIN_ITEMS
        messages.extend(messages_of(job_refs, group if many else 1))
    return messages
