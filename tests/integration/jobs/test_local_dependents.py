"""Dependents that become ready on the queue a delivery came from run in that delivery at once (claimed and
stored in PostgreSQL as usual), instead of a broker round trip; on a real PostgreSQL with an in-process transport."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Engine

from app.db import make_session_factory, session_scope
from app.jobs.distributed import NodeMessage, NodePolicy, Outcome, dispatch_job, run_node, sweep
from app.jobs.distributed.dispatch import GROUP_MIN_ITEMS
from app.jobs.service import describe_job
from app.pipeline.resources.types import LLMRequest, LLMResponse
from tests.support.distributed import ENDPOINTS, ListDispatcher, call_of, make_worker, node_statuses, submit
from tests.support.fakes import ScriptedLM
from workers.engine_host import LoopHost

REVIEWS = [{"custom_id": f"r{i}", "input": f"review number {i}: good sound, weak battery"} for i in range(4)]
MANY = [{"custom_id": f"m{i}", "input": f"review {i}: loud"} for i in range(GROUP_MIN_ITEMS)]


@pytest.fixture
def host() -> Iterator[LoopHost]:
    loop_host = LoopHost()
    yield loop_host
    loop_host.stop()


def _deliver(worker: object, dispatcher: ListDispatcher, here: bool = True) -> list[Outcome]:
    """Deliver every pending message (and those they send), each from its own queue, one at a time."""
    outcomes = []
    while batch := dispatcher.take():
        outcomes.extend(run_node(worker, call_of(m), here=m.queue if here else None) for m in batch)  # type: ignore[arg-type]
    return outcomes


@pytest.mark.parametrize("fast", [True, False], ids=["one-statement", "transactions"])
def test_a_dependent_ready_on_the_same_queue_runs_here_without_a_message(
    committed: Engine, host: LoopHost, fast: bool
) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host, fast=fast)
    job_id = submit(sessions, "review-compare", REVIEWS)
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    first_wave = list(dispatcher.pending)

    outcomes = _deliver(worker, dispatcher)

    assert outcomes == [Outcome.STORED] * len(first_wave)
    assert dispatcher.sent == first_wave  # the verdicts ran in the delivery that made them ready: no message
    with session_scope(sessions) as session:
        view = describe_job(session, job_id)
    assert view["status"] == "completed", view
    assert len(lm.calls) == 3 * len(REVIEWS)  # each LLM node called once
    assert node_statuses(sessions, job_id) == {"done": 4 * len(REVIEWS)}
    # a re-delivery of a producer's message finds its result stored and runs nothing again
    assert run_node(worker, call_of(first_wave[0], redelivered=True), here=first_wave[0].queue) is Outcome.ALREADY_DONE
    assert len(lm.calls) == 3 * len(REVIEWS) and dispatcher.take() == []


def test_a_dependent_on_another_queue_is_sent(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host)
    job_id = submit(sessions, "review-compare", REVIEWS[:2])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    # the deliveries came from a queue this worker's nodes are not routed to: every dependent takes a message
    while batch := dispatcher.take():
        for m in batch:
            assert run_node(worker, call_of(m), here="t.elsewhere") is Outcome.STORED
    verdicts = [m for m in dispatcher.sent if m.priority == 3]
    assert len(verdicts) == 2
    with session_scope(sessions) as session:
        assert describe_job(session, job_id)["status"] == "completed"


def test_no_local_run_when_the_chain_is_off(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host, policy=NodePolicy(local_chain=0))
    job_id = submit(sessions, "review-compare", REVIEWS[:2])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    _deliver(worker, dispatcher)
    assert len([m for m in dispatcher.sent if m.priority == 3]) == 2
    assert len(lm.calls) == 6


def test_a_dependent_left_queued_by_a_dead_worker_is_sent_by_the_sweeper(committed: Engine, host: LoopHost) -> None:
    """The worker dies after storing the producer and before claiming the dependent it would run here: the
    dependent is queued in PostgreSQL with a deadline, so the sweeper sends it, and it runs once."""
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    policy = NodePolicy(stale_s=0.0)  # due at once, so the sweep below finds it overdue
    worker = make_worker(committed, dispatcher, lm, host, policy=policy)
    job_id = submit(sessions, "review-compare", REVIEWS[:1])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    # the producers run with local runs off, and the dependents' messages are lost with the "dead" worker
    dead = replace(worker, policy=replace(policy, local_chain=0))
    for m in dispatcher.take():
        assert run_node(dead, call_of(m), here=m.queue) is Outcome.STORED
    lost: list[NodeMessage] = dispatcher.take()
    assert len(lost) == 1 and node_statuses(sessions, job_id).get("queued") == 1
    report = sweep(sessions, dispatcher, ENDPOINTS, policy, resources_for=lambda aliases: lm)
    assert report.resent == 1
    _deliver(worker, dispatcher)
    with session_scope(sessions) as session:
        assert describe_job(session, job_id)["status"] == "completed"
    assert len(lm.calls) == 3


class _Grouping(ListDispatcher):
    group = 4  # ready nodes of one job per message, as the Celery dispatcher of a worker sends them


def _deliver_grouped(worker: object, dispatcher: ListDispatcher) -> list[Outcome]:
    outcomes = []
    while batch := dispatcher.take():
        outcomes.extend(run_node(worker, call_of(m), here=m.queue, also=m.also) for m in batch)  # type: ignore[arg-type]
    return outcomes


def _grouped_job(
    committed: Engine, host: LoopHost, latency: float = 0.0, max_calls: int = 0
) -> tuple[Any, ScriptedLM, _Grouping, Any, str]:
    """A submitted job of MANY items, a grouping dispatcher and a worker that delivers to it."""
    sessions = make_session_factory(committed)
    lm = ScriptedLM(latency=latency)
    dispatcher = _Grouping()
    worker = make_worker(committed, dispatcher, lm, host, max_calls=max_calls)
    return sessions, lm, dispatcher, worker, submit(sessions, "review-compare", MANY)


def test_one_message_carries_ready_nodes_of_several_items_and_the_job_completes_once_each(
    committed: Engine, host: LoopHost
) -> None:
    sessions, lm, dispatcher, worker, job_id = _grouped_job(committed, host)

    sent = dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)

    assert sent == 2 * len(MANY)  # nodes sent: the two ready nodes of two items a message
    first_wave = list(dispatcher.pending)
    assert len(first_wave) == len(MANY) // 2 and all(m.nodes == 4 for m in first_wave)
    assert all(len(m.also[1]) == 3 and m.also[1][2] == m.item_id + 1 for m in first_wave)  # names its item
    assert _deliver_grouped(worker, dispatcher) == [Outcome.STORED] * len(first_wave)
    assert dispatcher.sent == first_wave  # the verdicts ran where they became ready
    with session_scope(sessions) as session:
        assert describe_job(session, job_id)["status"] == "completed"
    assert len(lm.calls) == 3 * len(MANY)
    assert node_statuses(sessions, job_id) == {"done": 4 * len(MANY)}
    # the broker gives a grouped message again (its worker died before the ack): nothing runs twice
    again = first_wave[0]
    assert run_node(worker, call_of(again, redelivered=True), also=again.also) is Outcome.ALREADY_DONE
    assert len(lm.calls) == 3 * len(MANY) and dispatcher.take() == []


def test_a_messages_nodes_run_together_within_the_workers_call_cap(committed: Engine, host: LoopHost) -> None:
    """The four calls of a message are in flight at once, then the two verdicts they make ready; a worker
    capped at two calls at once never has more."""
    sessions, lm, dispatcher, worker, job_id = _grouped_job(committed, host, latency=0.3)
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    message = dispatcher.take()[0]
    start = time.perf_counter()
    assert run_node(worker, call_of(message), here=message.queue, also=message.also) is Outcome.STORED
    elapsed = time.perf_counter() - start
    assert len(lm.calls) == 6 and lm.peak_in_flight == 4
    assert elapsed < 4 * 0.3  # two rounds of calls, not six calls one after another
    assert node_statuses(sessions, job_id)["done"] == 8  # both items' nodes

    capped_sessions, capped_lm, capped_dispatcher, capped, capped_job = _grouped_job(
        committed, host, latency=0.05, max_calls=2
    )
    dispatch_job(capped_sessions, capped_job, capped_dispatcher, ENDPOINTS)
    _deliver_grouped(capped, capped_dispatcher)
    assert len(capped_lm.calls) == 3 * len(MANY) and capped_lm.peak_in_flight == 2


def test_a_small_job_sends_one_node_a_message_to_keep_its_parallelism(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    dispatcher = _Grouping()
    job_id = submit(sessions, "review-compare", REVIEWS)
    assert dispatch_job(sessions, job_id, dispatcher, ENDPOINTS) == 2 * len(REVIEWS)
    assert len(dispatcher.sent) == 2 * len(REVIEWS) and all(m.also == () for m in dispatcher.sent)


def test_a_grouped_message_whose_worker_died_half_way_is_finished_by_its_redelivery(
    committed: Engine, host: LoopHost
) -> None:
    sessions, lm, dispatcher, worker, job_id = _grouped_job(committed, host)
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    message, *others = dispatcher.take()
    # the first delivery stored the first node and died before the others
    assert run_node(worker, call_of(message)) is Outcome.STORED
    assert len(lm.calls) == 1
    # the re-delivery finds the first stored, runs the other three (two items), then the verdicts they make ready
    assert run_node(worker, call_of(message, redelivered=True), here=message.queue, also=message.also) is (
        Outcome.ALREADY_DONE
    )
    assert len(lm.calls) == 6 and dispatcher.take() == []
    assert node_statuses(sessions, job_id)["done"] == 8  # those two items' nodes, each stored once
    dispatcher.pending.extend(others)
    _deliver_grouped(worker, dispatcher)
    with session_scope(sessions) as session:
        assert describe_job(session, job_id)["status"] == "completed"
    assert len(lm.calls) == 3 * len(MANY)


class _Staggered(ScriptedLM):
    """The first call takes 1.5 s; the others return one after another, 0.15 s apart."""

    def __init__(self) -> None:
        super().__init__()
        self._started = 0

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        n, self._started = self._started, self._started + 1
        await asyncio.sleep(1.5 if n == 0 else 0.15 * n)
        return await super().complete(alias, request)


def test_a_slow_node_keeps_its_lease_while_the_messages_other_calls_keep_returning(
    committed: Engine, host: LoopHost
) -> None:
    """Leases are renewed every third of a lease even while other calls of the message return more often than
    that (a renewal only on a quiet wait would let the slow node's lease lapse, and the sweeper re-run it)."""

    class EightANode(ListDispatcher):
        group = 8

    sessions = make_session_factory(committed)
    lm = _Staggered()
    dispatcher = EightANode()
    policy = NodePolicy(lease_s=0.6, stale_s=5.0)
    worker = make_worker(committed, dispatcher, lm, host, policy)
    job_id = submit(sessions, "review-compare", MANY)
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    message = dispatcher.take()[0]
    assert message.nodes == 8
    outcome: list[Outcome] = []
    runner = threading.Thread(target=lambda: outcome.append(run_node(worker, call_of(message), also=message.also)))
    runner.start()
    reports = []
    while runner.is_alive():
        time.sleep(0.1)
        reports.append(sweep(sessions, dispatcher, ENDPOINTS, policy))
    runner.join()
    assert outcome == [Outcome.STORED]
    assert all(r.requeued == 0 for r in reports)  # every lease stayed alive
    assert len(lm.calls) == 8
