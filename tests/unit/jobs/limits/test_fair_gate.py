"""The embedded executor's gate hands its slots out by the same fair-share policy as the dispatch windows."""

from __future__ import annotations

import asyncio

import pytest

from app.jobs.limits.fairness import FairGate, Share, endpoints_cap
from app.pipeline.resources.config import ResourceConfig

BIG = Share("big", "acme", 0, age=1.0)
SMALL = Share("small", "beta", 0, age=2.0)
URGENT = Share("urgent", "beta", -1, age=3.0)


async def _waiters(gate: FairGate, share: Share, count: int, order: list[str]) -> list[asyncio.Task[None]]:
    async def one() -> None:
        await gate.acquire(share)
        order.append(share.job_id)

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await asyncio.sleep(0)
    return tasks


def test_a_small_job_of_another_tenant_goes_ahead_of_the_big_jobs_queue() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(4)
        order: list[str] = []
        await _waiters(gate, BIG, 20, order)  # the big job fills the gate and queues 16 more
        assert gate.in_use == 4 and order == ["big"] * 4
        await _waiters(gate, SMALL, 3, order)
        for job in ["big"] * 4 + ["small"]:  # items finish one after another
            gate.release(job)
            await asyncio.sleep(0)
        return order[4:]

    # each freed slot goes to the tenant holding less: beta until both hold two, then alternately
    assert asyncio.run(scenario()) == ["small", "small", "big", "big", "small"]


def test_priority_comes_before_fair_share_and_equals_alternate() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(1)
        order: list[str] = []
        await _waiters(gate, BIG, 3, order)
        await _waiters(gate, SMALL, 2, order)
        await _waiters(gate, URGENT, 2, order)
        for job in ["big", "urgent", "urgent", "small", "big", "small"]:
            gate.release(job)
            await asyncio.sleep(0)
        return order

    assert asyncio.run(scenario()) == ["big", "urgent", "urgent", "small", "big", "small", "big"]


def test_weights_and_a_cancelled_waiter_give_its_place_back() -> None:
    async def scenario() -> tuple[list[str], int, int]:
        gate = FairGate(4, weights={"acme": 3.0})
        order: list[str] = []
        await _waiters(gate, BIG, 4, order)
        await _waiters(gate, BIG, 5, order)
        small = await _waiters(gate, SMALL, 2, order)
        small[0].cancel()
        await asyncio.sleep(0)
        for _ in range(3):
            gate.release("big")
            await asyncio.sleep(0)
        return order[4:], gate.held("small"), gate.in_use

    order, held, in_use = asyncio.run(scenario())
    # acme weighs 3: holding 3 it counts as 1, as beta holding 1 does; the cancelled waiter took nothing
    assert order == ["small", "big", "big"] and held == 1 and in_use == 4


def test_releasing_a_slot_not_held_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="did not hold"):
        FairGate(2).release("nobody")
    with pytest.raises(ValueError, match="at least one slot"):
        FairGate(0)


def test_the_endpoints_cap_is_twice_their_concurrency_when_all_are_limited() -> None:
    limited = ResourceConfig({"a": {"provider": "openai", "model": "m", "base_url": "http://x/v1", "max_concurrent": 8},
                              "b": {"provider": "openai", "model": "n", "base_url": "http://x/v1", "max_concurrent": 4}})
    assert endpoints_cap(limited) == 24
    unlimited = ResourceConfig({"a": {"provider": "openai", "model": "m", "base_url": "http://x/v1"}})
    assert endpoints_cap(unlimited) is None
    assert endpoints_cap(None) is None
    engine_only = ResourceConfig({"a": {"provider": "native", "model": "default"}})
    assert endpoints_cap(engine_only) is None


def test_a_slot_due_to_an_open_job_is_kept_for_it_until_it_asks_or_closes() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(1)
        order: list[str] = []
        gate.open(BIG)  # the urgent-enough job is between two requests (reading its next page)
        await _waiters(gate, BIG, 1, order)
        await _waiters(gate, Share("later", "beta", 5), 1, order)
        gate.release("big")  # due to the big job (priority 0), which is not waiting right now
        await asyncio.sleep(0)
        assert order == ["big"] and gate.in_use == 0  # kept free, not given to the less urgent job
        await _waiters(gate, BIG, 1, order)  # the big job asks: it gets it at once
        gate.release("big")
        gate.close("big")  # nothing more to start: the slot goes to the waiting job
        await asyncio.sleep(0)
        return order

    assert asyncio.run(scenario()) == ["big", "big", "later"]
