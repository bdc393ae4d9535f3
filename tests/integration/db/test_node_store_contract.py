"""The node store's contract, checked on every implementation: SQLAlchemy Core and raw psycopg on PostgreSQL,
SQLAlchemy Core and raw sqlite3 (its writer thread) on an SQLite file: every operation of
:class:`app.db.repository.node_store.NodeStore`.

Each test builds a job of items whose nodes form a diamond: ``a`` and ``b`` (queued), ``c`` (waits for both),
``d`` (waits for ``c``, the node every other one leads to)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.db import (
    ItemStatus,
    JobStatus,
    create_db_engine,
    make_session_factory,
    repository,
    session_scope,
    utcnow,
)
from app.db.direct import DirectPool
from app.db.migrate import upgrade
from app.db.models import Item, Job, JobMetrics, NodeResult, NodeTask, NodeTaskStatus
from app.db.repository import node_tasks as tasks_repo
from app.db.repository.node_store import (
    ClaimRequest,
    ClaimStatus,
    CoreNodeStore,
    Hold,
    ItemEnd,
    ItemMetrics,
    NodeStore,
    NodeValue,
    PsycopgNodeStore,
    SqliteNodeStore,
    StoredValues,
    open_node_store,
)
from app.jobs.distributed.settle import settle_job
from tests.support.postgres import committed, pg_engine, pg_url

__all__ = ["committed", "pg_engine", "pg_url"]

DEPENDENTS = {"a": ["c"], "b": ["c"], "c": ["d"], "d": []}
WAITING = {"a": 0, "b": 0, "c": 2, "d": 1}
LEASE = timedelta(seconds=60)


@dataclass
class Fixture:
    store: NodeStore
    sessions: sessionmaker[Session]
    job_id: str = ""
    items: tuple[int, ...] = ()


@pytest.fixture(params=["core", "psycopg", "sqlite-core", "sqlite"])
def nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fixture]:
    if request.param.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'nodes.db'}"
        upgrade(url)
        engine = create_db_engine(url)
        sessions = make_session_factory(engine)
        store: NodeStore = CoreNodeStore(sessions, settle_job)
        if request.param == "sqlite":
            store = open_node_store(sessions, settle_job)
            assert isinstance(store, SqliteNodeStore)
        try:
            yield Fixture(store, sessions)
        finally:
            getattr(store, "close", lambda: None)()
            engine.dispose()
        return
    sessions = make_session_factory(request.getfixturevalue("committed"))
    if request.param == "core":
        yield Fixture(CoreNodeStore(sessions, settle_job), sessions)
        return
    pool = DirectPool(request.getfixturevalue("pg_url"), size=8)
    try:
        yield Fixture(PsycopgNodeStore(sessions, settle_job, pool), sessions)
    finally:
        pool.close()


@pytest.fixture
def job(nodes: Fixture) -> Fixture:
    """A running job of two items, each with the diamond's nodes."""
    job_id = f"job_{uuid.uuid4().hex[:12]}"
    with session_scope(nodes.sessions) as session:
        pipeline = repository.get_or_create_pipeline(
            session, owner="anonymous", name="contract", import_path="tests:Contract"
        )
        repository.create_job(
            session, job_id=job_id, pipeline_id=pipeline.id, pipeline_name="contract", total_items=2
        )
        rows = [{"custom_id": f"c{i}", "position": i, "input": {"args": [i], "kwargs": {}}} for i in range(2)]
        repository.add_items(session, job_id=job_id, rows=rows)
        items = tuple(session.scalars(select(Item.id).where(Item.job_id == job_id).order_by(Item.position)))
        repository.claim_job(session, job_id=job_id)
        tasks_repo.add_node_tasks(
            session,
            rows=[
                {
                    "job_id": job_id,
                    "item_id": item_id,
                    "node_id": node,
                    "kind": "llm",
                    "status": NodeTaskStatus.QUEUED if waiting == 0 else NodeTaskStatus.WAITING,
                    "waiting": waiting,
                    "queue": "t.llm",
                    "priority": 5,
                    "deadline": utcnow() + LEASE,
                }
                for item_id in items
                for node, waiting in WAITING.items()
            ],
        )
    nodes.job_id, nodes.items = job_id, items
    return nodes


# -- helpers -------------------------------------------------------------------------------------------------
def request(
    f: Fixture, node: str, token: str, *, item: int = 0, redelivered: bool = False, cap: int = 5
) -> ClaimRequest:
    now = utcnow()
    return ClaimRequest(f.job_id, f.items[item], node, token, redelivered, cap, now + LEASE, now)


def value(f: Fixture, node: str, payload: Any, *, item: int = 0) -> NodeValue:
    return NodeValue(f.job_id, f.items[item], node, {"kind": "text", "payload": payload}, 1.5, 0, utcnow())


def store(f: Fixture, node: str, payload: Any, *, item: int = 0) -> Any:
    deadline = utcnow() + LEASE
    return f.store.store(value(f, node, payload, item=item), dependents=DEPENDENTS[node], deadline=deadline)


def node_row(f: Fixture, node: str, *, item: int = 0) -> NodeTask:
    with session_scope(f.sessions) as session:
        row = session.scalars(
            select(NodeTask).where(NodeTask.item_id == f.items[item], NodeTask.node_id == node)
        ).one()
        session.expunge(row)
        return row


def item_row(f: Fixture, *, item: int = 0) -> Item:
    with session_scope(f.sessions) as session:
        row = session.get(Item, f.items[item])
        assert row is not None
        session.expunge(row)
        return row


def job_row(f: Fixture) -> tuple[Job, JobMetrics]:
    with session_scope(f.sessions) as session:
        job, metrics = session.get(Job, f.job_id), session.get(JobMetrics, f.job_id)
        assert job is not None and metrics is not None
        session.expunge_all()
        return job, metrics


def results(f: Fixture, *, item: int = 0) -> dict[str, Any]:
    with session_scope(f.sessions) as session:
        stmt = select(NodeResult.node_id, NodeResult.value).where(NodeResult.item_id == f.items[item])
        return {node: stored for node, stored in session.execute(stmt)}


def complete(f: Fixture, *, item: int = 0) -> None:
    """Store a, b and c of the item (d is then queued)."""
    for node in ("a", "b", "c"):
        assert store(f, node, node.upper(), item=item).inserted


def aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)  # SQLite hands back naive UTC


def end(output: Any, calls: int = 1) -> ItemEnd:
    metrics = ItemMetrics(calls, 10 * calls, 5 * calls, 0.5, 40.0, 40.0)
    return ItemEnd(ItemStatus.COMPLETED, output, None, metrics)


# -- claim ---------------------------------------------------------------------------------------------------
def test_a_claim_is_exclusive(job: Fixture) -> None:
    first = job.store.claim(request(job, "a", "t1"))
    assert first.status is ClaimStatus.CLAIMED and first.attempts == 1
    assert first.item is not None and first.item.pipeline_name == "contract" and first.item.custom_id == "c0"
    assert first.item.item_input == {"args": [0], "kwargs": {}} and first.item.values == {}
    row = node_row(job, "a")
    assert (row.status, row.claimed_by, row.attempts) == (NodeTaskStatus.RUNNING, "t1", 1)
    assert item_row(job).status == ItemStatus.RUNNING
    # the same node and attempt again, by another delivery or a duplicate of this one: refused while leased
    assert job.store.claim(request(job, "a", "t2")).status is ClaimStatus.BUSY
    assert job.store.claim(request(job, "a", "t1")).status is ClaimStatus.BUSY
    assert node_row(job, "a").attempts == 1
    # only the broker's re-delivery of this very task takes its own claim over
    again = job.store.claim(request(job, "a", "t1", redelivered=True))
    assert again.status is ClaimStatus.CLAIMED and again.attempts == 2


def test_of_concurrent_claims_exactly_one_wins(job: Fixture) -> None:
    with ThreadPoolExecutor(6) as pool:
        claims = list(pool.map(lambda i: job.store.claim(request(job, "b", f"t{i}")), range(6)))
    assert sorted(c.status for c in claims) == [ClaimStatus.BUSY] * 5 + [ClaimStatus.CLAIMED]
    assert node_row(job, "b").attempts == 1


def test_claim_many_claims_each_as_claim_does(job: Fixture) -> None:
    """A delivery's nodes of both items at once: the queued ones are claimed with their own tokens and their
    items' stored values, the others get claim's answers, in the requests' order."""
    assert store(job, "a", "A", item=1).inserted
    now = utcnow()
    requests = [
        ClaimRequest(job.job_id, job.items[0], "a", "m1", False, 5, now + LEASE, now),
        ClaimRequest(job.job_id, job.items[1], "b", "m1", False, 5, now + LEASE, now),
        ClaimRequest(job.job_id, job.items[0], "c", "m1", False, 5, now + LEASE, now),  # waits for a and b
        ClaimRequest(job.job_id, job.items[1], "a", "m1", False, 5, now + LEASE, now),  # stored already
        ClaimRequest(job.job_id, job.items[0], "b", "here:x", False, 5, now + LEASE, now),
    ]
    claims = job.store.claim_many(requests)
    assert [c.status for c in claims] == [
        ClaimStatus.CLAIMED,
        ClaimStatus.CLAIMED,
        ClaimStatus.NOT_READY,
        ClaimStatus.ALREADY_DONE,
        ClaimStatus.CLAIMED,
    ]
    assert claims[1].item is not None and claims[1].item.values == {"a": {"kind": "text", "payload": "A"}}
    assert claims[0].item is not None and claims[0].item.custom_id == "c0" and claims[0].attempts == 1
    assert (node_row(job, "b").claimed_by, node_row(job, "b", item=1).claimed_by) == ("here:x", "m1")
    assert item_row(job).status == item_row(job, item=1).status == ItemStatus.RUNNING
    # the same nodes again: each busy, as a second claim finds it
    again = job.store.claim_many(requests[:2])
    assert [c.status for c in again] == [ClaimStatus.BUSY, ClaimStatus.BUSY]
    with session_scope(job.sessions) as session:
        repository.request_cancel(session, job_id=job.job_id)
    closed = job.store.claim_many([requests[2], requests[2]])
    assert [c.status for c in closed] == [ClaimStatus.NOT_READY, ClaimStatus.NOT_READY]


def test_claim_many_claims_a_node_listed_twice_once(job: Fixture) -> None:
    now = utcnow()
    twice = [ClaimRequest(job.job_id, job.items[0], "a", f"t{i}", False, 5, now + LEASE, now) for i in range(2)]
    other = ClaimRequest(job.job_id, job.items[1], "a", "t2", False, 5, now + LEASE, now)
    claims = job.store.claim_many([*twice, other])
    assert [c.status for c in claims] == [ClaimStatus.CLAIMED, ClaimStatus.BUSY, ClaimStatus.CLAIMED]
    assert node_row(job, "a").attempts == 1


def test_a_claim_refuses_nodes_not_ready_done_or_closed(job: Fixture) -> None:
    assert job.store.claim(request(job, "c", "t1")).status is ClaimStatus.NOT_READY
    assert store(job, "a", "A").inserted
    assert job.store.claim(request(job, "a", "t2")).status is ClaimStatus.ALREADY_DONE
    with session_scope(job.sessions) as session:
        repository.request_cancel(session, job_id=job.job_id)
    assert job.store.claim(request(job, "b", "t3")).status is ClaimStatus.CLOSED
    assert node_row(job, "b").status == NodeTaskStatus.FAILED  # a closed job's node will not run
    assert job.store.claim(request(job, "b", "t4")).status is ClaimStatus.CLOSED


def test_a_claim_past_the_attempts_cap_fails_the_item(job: Fixture) -> None:
    assert job.store.claim(request(job, "a", "t1", cap=1)).status is ClaimStatus.CLAIMED
    with session_scope(job.sessions) as session:  # its worker died: the lease ran out
        stmt = select(NodeTask).where(NodeTask.item_id == job.items[0], NodeTask.node_id == "a")
        session.scalars(stmt).one().deadline = utcnow() - LEASE
    assert job.store.claim(request(job, "a", "t2", cap=1)).status is ClaimStatus.EXHAUSTED
    item = item_row(job)
    assert item.status == ItemStatus.FAILED and item.error is not None
    assert item.error["type"] == "TooManyAttempts"
    assert {node_row(job, n).status for n in WAITING} == {NodeTaskStatus.FAILED}
    assert job_row(job)[0].failed_items == 1


# -- lease, values, store ------------------------------------------------------------------------------------
def test_renew_pushes_the_holders_lease_only(job: Fixture) -> None:
    job.store.claim(request(job, "a", "t1"))
    later = utcnow() + timedelta(hours=1)
    assert job.store.renew(item_id=job.items[0], node_id="a", token="t1", deadline=later)
    deadline = node_row(job, "a").deadline
    assert deadline is not None and abs((aware(deadline) - later).total_seconds()) < 1e-3
    assert not job.store.renew(item_id=job.items[0], node_id="a", token="t2", deadline=later)


def test_storing_twice_changes_nothing_the_second_time(job: Fixture) -> None:
    job.store.claim(request(job, "a", "t1"))
    first = store(job, "a", "A")
    assert first.inserted and first.ready == [] and first.job_status == JobStatus.RUNNING
    assert node_row(job, "a").status == NodeTaskStatus.DONE
    assert node_row(job, "c").waiting == 1
    second = store(job, "a", "something else")
    assert not second.inserted and second.ready == [] and second.job_status == JobStatus.RUNNING
    assert node_row(job, "c").waiting == 1  # counted down exactly once
    assert results(job) == {"a": {"kind": "text", "payload": "A"}}  # the first value stays


def test_the_last_dependency_queues_a_dependent_exactly_once(job: Fixture) -> None:
    assert store(job, "a", "A").ready == []
    ready = store(job, "b", "B").ready
    assert [(r.job_id, r.item_id, r.node_id, r.attempts, r.queue, r.priority) for r in ready] == [
        (job.job_id, job.items[0], "c", 0, "t.llm", 5)
    ]
    c = node_row(job, "c")
    assert (c.status, c.waiting) == (NodeTaskStatus.QUEUED, 0)
    assert store(job, "b", "B").ready == [] and store(job, "a", "A").ready == []
    assert node_row(job, "c").waiting == 0
    assert node_row(job, "a", item=1).status == NodeTaskStatus.QUEUED  # the other item is untouched


def test_held_dependents_count_as_sent_until_the_hold_ends(job: Fixture) -> None:
    """Dependents the storing delivery runs itself (ready on the held queue, or an ``op`` node, an F.* op, on any
    queue) are marked sent and due when the hold ends; the others are due at once, for the windows to send."""
    until = utcnow() + timedelta(seconds=30)
    with session_scope(job.sessions) as session:
        stmt = select(NodeTask).where(NodeTask.item_id == job.items[1], NodeTask.node_id == "c")
        session.scalars(stmt).one().kind = "op"
    for item in (0, 1):
        for node in ("a", "b"):
            stored = job.store.store(
                value(job, node, node, item=item), dependents=["c"], deadline=utcnow(), hold=Hold(None, until)
            )
            assert stored.inserted
    # the store that made the op ready may hand over the item's values for it (in its own transaction)
    assert stored.values is None or stored.values == results(job, item=1) == {
        "a": {"kind": "text", "payload": "a"},
        "b": {"kind": "text", "payload": "b"},
    }
    plain, op = node_row(job, "c"), node_row(job, "c", item=1)
    assert plain.status == op.status == NodeTaskStatus.QUEUED
    assert plain.sent_at is None  # an llm node, and no queue held: the windows send it
    assert op.sent_at is not None and op.deadline is not None
    assert abs((aware(op.deadline) - until).total_seconds()) < 1e-3
    ready = job.store.store(value(job, "c", "C"), dependents=["d"], deadline=utcnow(), hold=Hold("t.llm", until))
    assert [r.node_id for r in ready.ready] == ["d"]
    d = node_row(job, "d")
    assert d.sent_at is not None and d.deadline is not None  # ready on the held queue
    assert abs((aware(d.deadline) - until).total_seconds()) < 1e-3


def test_a_closed_job_releases_no_dependent(job: Fixture) -> None:
    store(job, "a", "A")
    with session_scope(job.sessions) as session:
        repository.request_cancel(session, job_id=job.job_id)
    stored = store(job, "b", "B")
    assert stored.inserted and stored.ready == [] and stored.job_status == JobStatus.CANCELLING
    assert node_row(job, "c").status == NodeTaskStatus.WAITING


def test_item_values_come_back_as_stored(job: Fixture) -> None:
    assert job.store.item_values(item_id=job.items[0]) == {}
    nested = {"kind": "json", "payload": {"list": [1, 2.5, None], "text": "é\n"}, "meta": {"model": "m"}}
    a = NodeValue(job.job_id, job.items[0], "a", nested, 1.0, 0, utcnow())
    job.store.store(a, dependents=["c"], deadline=utcnow())
    store(job, "b", "B")
    expected = {"a": nested, "b": {"kind": "text", "payload": "B"}}
    assert job.store.item_values(item_id=job.items[0]) == expected
    assert job.store.item_values(item_id=job.items[1]) == {}
    claim = job.store.claim(request(job, "c", "t1"))  # a claim hands them over too
    assert claim.item is not None and claim.item.values == expected


# -- an item's last node -------------------------------------------------------------------------------------
def test_store_last_completes_the_item_and_after_the_last_item_the_job(job: Fixture) -> None:
    for item in (0, 1):
        complete(job, item=item)
    first = job.store.store_last(value(job, "d", "D"), end({"verdict": "yes"}))
    assert first.inserted and first.progress is not None and not first.progress.finished
    assert (first.progress.completed, first.progress.total) == (1, 2)
    item = item_row(job)
    assert item.status == ItemStatus.COMPLETED and item.output == {"verdict": "yes"} and item.result_seq == 1
    assert node_row(job, "d").status == NodeTaskStatus.DONE
    assert job_row(job)[0].status == JobStatus.RUNNING
    # a duplicate delivery of the same node changes nothing
    again = job.store.store_last(value(job, "d", "other"), end({"verdict": "no"}))
    assert not again.inserted and again.progress is None
    assert item_row(job).output == {"verdict": "yes"} and job_row(job)[0].completed_items == 1
    last = job.store.store_last(value(job, "d", "D", item=1), end({"verdict": "no"}))
    assert last.inserted and last.progress is not None and last.progress.finished
    done, metrics = job_row(job)
    assert done.status == JobStatus.COMPLETED and done.completed_items == 2 and done.results_seq == 2
    # each item's metrics counted once
    assert (metrics.llm_calls, metrics.input_tokens, metrics.output_tokens) == (2, 20, 10)
    assert metrics.trace is not None  # the settled job's trace


def test_store_last_on_a_closed_item_stores_the_result_only(job: Fixture) -> None:
    complete(job)
    with session_scope(job.sessions) as session:
        session.get(Item, job.items[0]).status = ItemStatus.CANCELLED  # type: ignore[union-attr]
    stored = job.store.store_last(value(job, "d", "D"), end("x"))
    assert stored.inserted and stored.progress is None
    assert item_row(job).status == ItemStatus.CANCELLED and "d" in results(job)
    assert job_row(job)[0].completed_items == 0


def test_store_sink_finishes_the_item_once_no_node_is_left(job: Fixture) -> None:
    seen: list[dict[str, Any]] = []

    def decide(stored: StoredValues) -> ItemEnd:
        seen.append(stored())
        return end(sorted(seen[-1]), calls=0)

    store(job, "a", "A")
    early = job.store.store_sink(value(job, "d", "D"), decide)  # b and c are unfinished: the item stays open
    assert early.inserted and early.progress is None and seen == []
    assert item_row(job).status == ItemStatus.PENDING
    store(job, "b", "B")
    assert job.store.store_sink(value(job, "c", "C"), decide).progress is not None  # the last one
    assert set(seen[0]) == {"a", "b", "c", "d"}
    item = item_row(job)
    assert item.status == ItemStatus.COMPLETED and item.output == ["a", "b", "c", "d"]
    assert not job.store.store_sink(value(job, "c", "C"), decide).inserted and len(seen) == 1


def test_finish_item_waits_for_every_node(job: Fixture) -> None:
    complete(job)
    assert job.store.finish_item(job_id=job.job_id, item_id=job.items[0], end=lambda stored: end("x")) is None
    store(job, "d", "D")
    progress = job.store.finish_item(job_id=job.job_id, item_id=job.items[0], end=lambda got: end(got()))
    assert progress is not None and (progress.completed, progress.finished) == (1, False)
    assert item_row(job).output == {n: {"kind": "text", "payload": n.upper()} for n in WAITING}
    assert job.store.finish_item(job_id=job.job_id, item_id=job.items[0], end=lambda stored: end("x")) is None


# -- retry, failure, settling --------------------------------------------------------------------------------
def test_requeue_takes_the_node_back_from_its_holder_only(job: Fixture) -> None:
    job.store.claim(request(job, "a", "t1"))
    due = utcnow() + timedelta(seconds=5)
    assert job.store.requeue(item_id=job.items[0], node_id="a", token="t2", deadline=due) is None
    ref = job.store.requeue(item_id=job.items[0], node_id="a", token="t1", deadline=due)
    assert ref is not None and (ref.node_id, ref.attempts) == ("a", 1)
    row = node_row(job, "a")
    assert (row.status, row.claimed_by) == (NodeTaskStatus.QUEUED, None)
    assert job.store.requeue(item_id=job.items[0], node_id="a", token="t1", deadline=due) is None
    assert job.store.claim(request(job, "a", "t3")).attempts == 2


def test_fail_fails_the_item_and_the_job_after_its_last_item(job: Fixture) -> None:
    job.store.claim(request(job, "a", "t1"))
    error = {"type": "Boom", "message": "no"}
    job.store.fail(job_id=job.job_id, item_id=job.items[0], node_id="a", error=error)
    item = item_row(job)
    assert item.status == ItemStatus.FAILED and item.error == error
    assert {node_row(job, n).status for n in WAITING} == {NodeTaskStatus.FAILED}
    assert job_row(job)[0].status == JobStatus.RUNNING
    # the item failed already: nothing changes
    job.store.fail(job_id=job.job_id, item_id=job.items[0], node_id="b", error=error)
    assert job_row(job)[0].failed_items == 1
    job.store.fail(job_id=job.job_id, item_id=job.items[1], node_id="a", error=error)
    assert job_row(job)[0].status == JobStatus.FAILED  # every item failed


def test_settle_ends_a_cancelled_job_once_no_node_runs(job: Fixture) -> None:
    job.store.claim(request(job, "a", "t1"))
    with session_scope(job.sessions) as session:
        repository.request_cancel(session, job_id=job.job_id)
    job.store.settle(job_id=job.job_id)
    assert job_row(job)[0].status == JobStatus.CANCELLING  # node a still runs
    job.store.fail(job_id=job.job_id, item_id=job.items[0], node_id="a", error={"type": "Cancelled"})
    job.store.settle(job_id=job.job_id)
    assert job_row(job)[0].status == JobStatus.CANCELLED
    assert item_row(job, item=1).status == ItemStatus.CANCELLED
