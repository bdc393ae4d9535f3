"""Who runs next when capacity frees up: one policy for both transports (Celery workers and the embedded queue).

1. Lower job ``priority`` values go first: a level gets nothing while a more urgent level still has work.
2. Among jobs of equal priority, capacity is shared between tenants by weighted fair queuing on what each holds
   in flight: the next slot goes to the tenant with the least ``in_flight / weight`` (weights from settings,
   1 by default). Work is of similar size here (one node task, or one item), so this is deficit round robin
   without the bookkeeping of rounds, and it needs no state beyond the counts PostgreSQL already has: any
   number of dispatchers, in any process, reach the same order.
3. Within a tenant, the same between its jobs (ties: the older job first).
4. A tenant's quota of node tasks in flight caps what it gets, whatever its share.

The policy is pure functions without I/O: the distributed dispatcher feeds them counts from PostgreSQL; the
embedded executor's :class:`FairGate` its own.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.pipeline.resources.config import ResourceConfig


@dataclass(frozen=True, slots=True)
class Demand:
    """One job competing for slots. ``in_flight``: what it holds now (on the capacity being shared);
    ``available``: how many more it can use (None: as many as it is given); ``age``: the tie-break among equals,
    lower first (submission time, or when the job was last served)."""

    job_id: str
    tenant: str
    priority: int
    in_flight: int = 0
    available: int | None = None
    age: float = 0.0


def allocate(
    free: int,
    demands: Sequence[Demand],
    *,
    weights: Mapping[str, float] | None = None,
    tenant_room: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """How many of ``free`` slots each job gets (jobs given nothing are left out), by the policy above.

    ``tenant_room``: how many more slots a tenant may take (its quota minus what it holds); tenants missing
    from it have no quota. Each slot goes where it lowers the unfairness most, so the outcome is the same as
    handing slots out one by one as they free up."""
    weights = weights or {}
    room = dict(tenant_room or {})
    granted: dict[str, int] = {}
    tenant_load: dict[str, int] = {}
    for d in demands:
        tenant_load[d.tenant] = tenant_load.get(d.tenant, 0) + d.in_flight
    open_demands = [d for d in demands if d.available is None or d.available > 0]
    for _ in range(max(0, free)):
        pick = _next(open_demands, granted, tenant_load, weights, room)
        if pick is None:
            break
        granted[pick.job_id] = granted.get(pick.job_id, 0) + 1
        tenant_load[pick.tenant] += 1
        if pick.tenant in room:
            room[pick.tenant] -= 1
        if pick.available is not None and granted[pick.job_id] >= pick.available:
            open_demands.remove(pick)
    return granted


def _next(
    demands: Sequence[Demand],
    granted: Mapping[str, int],
    tenant_load: Mapping[str, int],
    weights: Mapping[str, float],
    room: Mapping[str, int],
) -> Demand | None:
    eligible = [d for d in demands if room.get(d.tenant, 1) > 0]
    if not eligible:
        return None
    level = min(d.priority for d in eligible)

    def key(d: Demand) -> tuple[float, int, float, str]:
        share = tenant_load[d.tenant] / max(weights.get(d.tenant, 1.0), 1e-9)
        return (share, d.in_flight + granted.get(d.job_id, 0), d.age, d.job_id)

    return min((d for d in eligible if d.priority == level), key=key)


def next_job(
    waiting: Sequence[Demand],
    *,
    weights: Mapping[str, float] | None = None,
    tenant_room: Mapping[str, int] | None = None,
) -> str | None:
    """The job whose waiting work runs next when one slot frees up (None: nobody may take it)."""
    granted = allocate(1, waiting, weights=weights, tenant_room=tenant_room)
    return next(iter(granted), None)


def endpoints_cap(config: ResourceConfig | None) -> int | None:
    """Twice the calls the remote endpoints of ``config`` take at once (so a piece of work waits ready as each
    call ends), when every one of them sets ``max_concurrent``; None otherwise. More work than that in flight
    only makes a later job wait behind it at the endpoints. The in-process engine (provider native without a
    URL) is not a remote endpoint."""
    if config is None:
        return None
    limits: dict[tuple[str, str | None, str], int | None] = {}
    for alias in config:
        for e in config[alias]:
            if e.provider == "native" and not e.base_url:
                continue
            limits[(e.provider, e.base_url, e.model)] = e.max_concurrent
    if not limits or any(limit is None for limit in limits.values()):
        return None
    return 2 * sum(int(limit or 0) for limit in limits.values())


@dataclass(frozen=True, slots=True)
class Share:
    """Who a piece of work belongs to, for the gate."""

    job_id: str
    tenant: str
    priority: int
    age: float = 0.0


class FairGate:
    """``capacity`` slots shared by the jobs of one process (the embedded executor's items in flight), handed out
    by the same policy as the distributed dispatch windows: when a slot frees, the job that :func:`next_job`
    names gets it. A job that has more to start declares it (:meth:`open` ... :meth:`close`): the policy counts
    it as wanting a slot even between two of its requests, and a slot it is due is kept for it rather than
    given to a less urgent job that happens to be waiting. Not thread-safe: use it from one event loop."""

    def __init__(self, capacity: int, *, weights: Mapping[str, float] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a gate needs at least one slot, not {capacity}")
        self.capacity = capacity
        self.weights = dict(weights or {})
        self._held: dict[str, int] = {}
        self._shares: dict[str, Share] = {}
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        # grants so far, and the job's last one: among equals the job served longest ago goes first, so two
        # tenants holding the same alternate (a job never served comes first, the older first)
        self._grants = 0
        self._served: dict[str, int] = {}
        self._open: set[str] = set()

    def open(self, share: Share) -> None:
        """``share``'s job has work to start (until :meth:`close`)."""
        self._shares[share.job_id] = share
        self._open.add(share.job_id)

    def close(self, job_id: str) -> None:
        """The job has nothing more to start: slots it was due go to others."""
        self._open.discard(job_id)
        if not self._held.get(job_id) and not self._waiting.get(job_id):
            self._shares.pop(job_id, None)
            self._served.pop(job_id, None)
        self._grant()

    @property
    def in_use(self) -> int:
        return sum(self._held.values())

    def held(self, job_id: str) -> int:
        return self._held.get(job_id, 0)

    async def acquire(self, share: Share) -> None:
        """Wait for a slot for ``share``'s job (immediately when one is free and nobody waits)."""
        self._shares[share.job_id] = share
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(share.job_id, deque()).append(future)
        self._grant()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(share.job_id)  # granted while being cancelled: give it back
            else:
                self._drop(share.job_id, future)
            raise

    def release(self, job_id: str) -> None:
        held = self._held.get(job_id, 0)
        if held <= 0:
            raise RuntimeError(f"job {job_id} released a slot of the gate it did not hold")
        if held == 1:
            del self._held[job_id]
            if not self._waiting.get(job_id) and job_id not in self._open:
                self._shares.pop(job_id, None)
                self._served.pop(job_id, None)
        else:
            self._held[job_id] = held - 1
        self._grant()

    def _drop(self, job_id: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(job_id)
        if queue is not None and future in queue:
            queue.remove(future)
        if not queue:
            self._waiting.pop(job_id, None)
        self._grant()

    def _grant(self) -> None:
        while self.in_use < self.capacity:
            demands = [
                Demand(job_id, share.tenant, share.priority, self._held.get(job_id, 0),
                       len(self._waiting.get(job_id, ())) or int(job_id in self._open), self._order(job_id, share))
                for job_id, share in self._shares.items()
            ]
            job_id = next_job(demands, weights=self.weights)
            if job_id is None or not self._waiting.get(job_id):
                return  # nobody wants a slot, or the slot is due to a job about to ask for it
            future = self._waiting[job_id].popleft()
            if not self._waiting[job_id]:
                del self._waiting[job_id]
            if future.done():  # its waiter was cancelled and has not run its clean-up yet
                continue
            self._held[job_id] = self._held.get(job_id, 0) + 1
            self._grants += 1
            self._served[job_id] = self._grants
            future.set_result(None)

    def _order(self, job_id: str, share: Share) -> float:
        served = self._served.get(job_id)
        return float(served) if served is not None else share.age - 1e18
