"""Who runs next when capacity frees up: one policy for both transports (Celery workers and the embedded queue).

1. Lower job ``priority`` values go first: a level gets nothing while a more urgent level still has work.
2. Among jobs of equal priority, capacity is shared between tenants by weighted fair queuing on what each holds
   in flight: the next slot goes to the tenant with the least ``in_flight / weight`` (weights from settings,
   1 by default). Work is of similar size here (one node task, or one item), so this is deficit round robin
   without the bookkeeping of rounds, and it needs no state beyond the counts PostgreSQL already has: any
   number of dispatchers, in any process, reach the same order.
3. Within a tenant, the same between its jobs (ties: the older job first).
4. A tenant's quota of node tasks in flight caps what it gets, whatever its share.

The policy is pure functions without I/O: the dispatch windows (:mod:`app.jobs.distributed.window`, for both
transports) feed them counts from the database.
"""

from __future__ import annotations

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
    if len(open_demands) == 1:  # one job wants slots (the common case): it gets what it can take, at once
        only = open_demands[0]
        n = max(0, free)
        if only.available is not None:
            n = min(n, only.available)
        if only.tenant in room:
            n = min(n, room[only.tenant])
        return {only.job_id: n} if n > 0 else {}
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
