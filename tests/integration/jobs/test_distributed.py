"""The distributed path on a real PostgreSQL, with an in-process transport: dispatch, the node function a worker
runs, re-deliveries, retries, the attempts cap, cancel and the sweeper."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import pytest
from sqlalchemy import Engine, update

from app.db import make_session_factory, session_scope, utcnow
from app.db.models import NodeTask
from app.jobs.distributed import NodeMessage, NodePolicy, Outcome, dispatch_job, run_node, sweep
from app.jobs.distributed.window import DispatchWindow, WindowPolicy
from app.jobs.service import cancel_job, describe_job, results_page, stored_trace
from app.pipeline.resources.errors import TransientError
from tests.support.distributed import (
    ENDPOINTS,
    ListDispatcher,
    call_of,
    drain,
    make_worker,
    node_statuses,
    submit,
)
from tests.support.fakes import ScriptedLM
from workers.engine_host import LoopHost

REVIEWS = [{"custom_id": f"r{i}", "input": f"review number {i}: good sound, weak battery"} for i in range(6)]


@pytest.fixture
def host() -> Iterator[LoopHost]:
    loop_host = LoopHost()
    yield loop_host
    loop_host.stop()


def _view(engine: Engine, job_id: str) -> dict[str, object]:
    with session_scope(make_session_factory(engine)) as session:
        return describe_job(session, job_id)


@pytest.mark.parametrize("fast", [True, False], ids=["one-statement", "transactions"])
def test_a_job_runs_node_by_node_and_each_node_once(committed: Engine, host: LoopHost, fast: bool) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host, fast=fast)
    job_id = submit(sessions, "review-compare", REVIEWS)

    sent = dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    assert sent == 2 * len(REVIEWS)  # praise and complaints of every item wait for nothing
    assert {m.queue for m in dispatcher.sent} == {"t.engine"}  # no resources file: the in-process engine
    assert {m.priority for m in dispatcher.sent} == {5}  # depth 1: one level above a job's start (6)
    assert _view(committed, job_id)["status"] == "running"

    outcomes = drain(worker, dispatcher)
    assert outcomes.count(Outcome.STORED) == 3 * len(REVIEWS)
    view = _view(committed, job_id)
    assert view["status"] == "completed", view
    assert view["usage"]["llm_calls"] == 3 * len(REVIEWS)  # type: ignore[index]
    assert len(lm.calls) == 3 * len(REVIEWS)  # the F.render op ran inline, the verdicts once each
    verdicts = [m for m in dispatcher.sent if m.priority == 3]  # depth 3 (after the inline op)
    assert len(verdicts) == len(REVIEWS)
    assert node_statuses(sessions, job_id) == {"done": 4 * len(REVIEWS)}
    with session_scope(sessions) as session:
        lines = results_page(session, job_id).lines
    assert sorted(line["custom_id"] for line in lines) == sorted(r["custom_id"] for r in REVIEWS)
    assert all(set(line["output"]) == {"liked", "disliked", "verdict"} for line in lines)
    with session_scope(sessions) as session:
        trace = stored_trace(session, job_id)
    assert trace is not None
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * len(REVIEWS) and all(e["dur"] >= 0 for e in spans)  # one per node task that ran

    # a re-delivered message (its worker died after storing) finds the result and does nothing
    again = run_node(worker, call_of(dispatcher.sent[0], redelivered=True))
    assert again is Outcome.ALREADY_DONE
    assert len(lm.calls) == 3 * len(REVIEWS) and dispatcher.take() == []


@pytest.mark.parametrize("fast", [True, False], ids=["one-statement", "transactions"])
def test_two_deliveries_of_one_node_store_it_once(committed: Engine, host: LoopHost, fast: bool) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM(latency=0.2)
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host, fast=fast)
    job_id = submit(sessions, "review-compare", REVIEWS[:1])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    first = dispatcher.take()
    # the same message twice at once (a duplicate send): one runs, the other sees a live claim
    outcomes = drain(worker, ListDispatcher(pending=[first[0], first[0]]), threads=2)
    assert sorted(outcomes) == sorted([Outcome.STORED, Outcome.BUSY])
    dispatcher.pending.extend(first[1:])
    drain(worker, dispatcher)
    assert _view(committed, job_id)["status"] == "completed"
    assert len(lm.calls) == 3


def test_transient_errors_retry_with_backoff_then_fail_cleanly(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    failures = {"left": 1}

    def reply(alias: str, request: object) -> str:
        if "flaky" in str(getattr(request, "prompt", "")) and failures["left"] > 0:
            failures["left"] -= 1
            raise TransientError("502 from upstream (scripted)")
        if "broken" in str(getattr(request, "prompt", "")):
            raise TransientError("always down (scripted)")
        return "fine"

    lm = ScriptedLM(reply=reply, max_retries=2)
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host, NodePolicy(retry_delay_s=0.5, stale_s=5.0))
    job_id = submit(sessions, "review-compare", [{"custom_id": "a", "input": "flaky"},
                                                 {"custom_id": "b", "input": "broken"}])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    outcomes = drain(worker, dispatcher)
    retries = [m for m in dispatcher.sent if m.countdown > 0]
    assert {m.countdown for m in retries} >= {0.5, 1.0}  # doubled per attempt
    assert Outcome.RETRY in outcomes and Outcome.FAILED in outcomes
    with session_scope(sessions) as session:
        lines = {line["custom_id"]: line for line in results_page(session, job_id).lines}
    assert lines["a"]["status"] == "completed"
    assert lines["b"]["status"] == "failed"
    assert lines["b"]["error"]["type"] == "TransientError" and "always down" in lines["b"]["error"]["message"]
    # budget: 1 + max_retries attempts of the failing node, then the item failed and its other nodes closed
    assert _view(committed, job_id)["status"] == "completed"


def test_a_node_whose_worker_keeps_dying_fails_its_item_after_the_cap(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    policy = NodePolicy(lease_s=30.0, stale_s=5.0, max_attempts=3)
    worker = make_worker(committed, dispatcher, lm, host, policy)
    job_id = submit(sessions, "review-compare", REVIEWS[:2])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    doomed = dispatcher.take()
    target = doomed[0]
    dispatcher.pending.extend(doomed[1:])
    for attempt in range(3):
        # a worker claims the node and dies before storing: claim by hand, then let the lease run out
        with session_scope(sessions) as session:
            session.execute(
                update(NodeTask)
                .where(NodeTask.item_id == target.item_id, NodeTask.node_id == target.node_id)
                .values(status="running", attempts=NodeTask.attempts + 1, claimed_by=f"dead-{attempt}",
                        deadline=utcnow() - timedelta(seconds=1))
            )
        report = sweep(sessions, dispatcher, ENDPOINTS, policy)
        if attempt < 2:
            assert report.requeued == 1
            taken = dispatcher.take()
            resent = [m for m in taken if (m.item_id, m.node_id) == (target.item_id, target.node_id)]
            assert [m.attempt for m in resent] == [attempt + 1]  # a new attempt: a new task id
            dispatcher.pending.extend(m for m in taken if m not in resent)
        else:
            assert report.failed == 1
    drain(worker, dispatcher)
    with session_scope(sessions) as session:
        lines = {line["custom_id"]: line for line in results_page(session, job_id).lines}
    failed = lines[REVIEWS[0]["custom_id"]]
    assert failed["status"] == "failed" and failed["error"]["type"] == "TooManyAttempts"
    assert lines[REVIEWS[1]["custom_id"]]["status"] == "completed"
    view = _view(committed, job_id)
    assert view["status"] == "completed"


def test_cancel_stops_dispatching_and_finishes_once_workers_stop(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host)
    job_id = submit(sessions, "review-compare", REVIEWS)
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    first_wave = dispatcher.take()
    for message in first_wave[:2]:  # one item's first wave: its verdict becomes ready and is sent
        assert run_node(worker, call_of(message)) is Outcome.STORED
    assert len(dispatcher.pending) == 1
    with session_scope(sessions) as session:
        assert cancel_job(session, job_id).status == "cancelling"
    outcomes = [run_node(worker, call_of(m)) for m in [*dispatcher.take(), *first_wave[2:]]]
    assert set(outcomes) == {Outcome.CLOSED}  # nothing runs, nothing more is sent
    assert dispatcher.take() == [] and len(lm.calls) == 2
    view = _view(committed, job_id)
    assert view["status"] == "cancelled", view
    with session_scope(sessions) as session:
        statuses = {line["status"] for line in results_page(session, job_id).lines}
    assert statuses == {"cancelled"}


def test_sweeper_resends_lost_messages_and_dispatches_stalled_jobs(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher(fail_sends=1)  # the broker is down while the job is dispatched
    worker = make_worker(committed, dispatcher, lm, host)
    job_id = submit(sessions, "review-compare", REVIEWS[:3])
    policy = NodePolicy(stale_s=5.0)
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS, policy)
    assert dispatcher.sent == []
    assert sweep(sessions, dispatcher, ENDPOINTS, policy).resent == 0  # not overdue yet
    dispatcher.pending.append(_unrelated(job_id))  # another node waits in the queue: a backlog
    report = sweep(sessions, dispatcher, ENDPOINTS, policy, now=utcnow() + timedelta(seconds=6))
    assert report.resent == 0  # its queue is not empty: the messages may still be waiting in it
    report = sweep(sessions, dispatcher, ENDPOINTS, policy, now=utcnow() + timedelta(seconds=6 + 3600))
    assert report.resent == 6  # so long overdue that they were lost, backlog or not
    dispatcher.take()
    report = sweep(sessions, dispatcher, ENDPOINTS, policy, now=utcnow() + timedelta(seconds=3620))
    assert report.resent == 6 and report.requeued == 0  # once the queue is empty they are sent again
    drain(worker, dispatcher)
    assert _view(committed, job_id)["status"] == "completed"

    # a job whose dispatch never happened (the API died right after the commit)
    stalled = submit(sessions, "review-compare", REVIEWS[:2])
    report = sweep(sessions, dispatcher, ENDPOINTS, policy, now=utcnow() + timedelta(seconds=6))
    assert report.dispatched == 4
    drain(worker, dispatcher)
    assert _view(committed, stalled)["status"] == "completed"


def test_sweeper_expires_jobs_past_their_window(committed: Engine, host: LoopHost) -> None:
    sessions = make_session_factory(committed)
    dispatcher = ListDispatcher()
    job_id = submit(sessions, "review-compare", REVIEWS[:2])
    with session_scope(sessions) as session:
        from app.db import Job

        session.execute(update(Job).where(Job.id == job_id).values(expires_at=utcnow() - timedelta(seconds=1)))
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    report = sweep(sessions, dispatcher, ENDPOINTS, NodePolicy())
    assert report.expired == 1 and report.settled == 1
    view = _view(committed, job_id)
    assert view["status"] == "cancelled"
    assert view["error"]["type"] == "Expired"  # type: ignore[index]
    worker = make_worker(committed, dispatcher, ScriptedLM(), host)
    assert set(drain(worker, dispatcher)) == {Outcome.CLOSED}


def test_sweeper_finishes_items_whose_worker_stopped_after_their_last_node(
    committed: Engine, host: LoopHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.db.repository import node_runs

    sessions = make_session_factory(committed)
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, ScriptedLM(), host, fast=False)
    job_id = submit(sessions, "review-compare", REVIEWS[:3])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    # every node is stored, but the item's outcome never is (the state a worker leaves when it stops between
    # storing an item's last node and finishing that item)
    with monkeypatch.context() as patch:
        patch.setattr(node_runs, "finish_open_item", lambda session, **kwargs: None)
        patch.setattr(node_runs, "finish_item", lambda session, **kwargs: None)
        drain(worker, dispatcher)
    assert node_statuses(sessions, job_id) == {"done": 12}
    assert _view(committed, job_id)["counts"]["completed"] == 0  # type: ignore[index]
    report = sweep(sessions, dispatcher, ENDPOINTS, NodePolicy(), resources_for=lambda aliases: None)
    assert report.finished == 3
    view = _view(committed, job_id)
    assert view["status"] == "completed" and view["usage"]["llm_calls"] == 9  # type: ignore[index]


@pytest.mark.parametrize("fast", [True, False], ids=["one-statement", "transactions"])
def test_a_delivery_past_the_attempts_cap_fails_the_item_cleanly(
    committed: Engine, host: LoopHost, fast: bool
) -> None:
    sessions = make_session_factory(committed)
    lm = ScriptedLM()
    dispatcher = ListDispatcher()
    worker = make_worker(committed, dispatcher, lm, host, NodePolicy(max_attempts=2), fast=fast)
    job_id = submit(sessions, "review-compare", REVIEWS[:1])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    first, second = dispatcher.take()
    with session_scope(sessions) as session:  # two earlier deliveries started it and their workers died
        session.execute(
            update(NodeTask)
            .where(NodeTask.item_id == first.item_id, NodeTask.node_id == first.node_id)
            .values(attempts=2)
        )
    assert run_node(worker, call_of(first, redelivered=True)) is Outcome.FAILED
    assert run_node(worker, call_of(second)) is Outcome.CLOSED  # the item is terminal: its other node stops
    assert lm.calls == []
    with session_scope(sessions) as session:
        (line,) = results_page(session, job_id).lines
    assert line["status"] == "failed" and line["error"]["type"] == "TooManyAttempts"
    assert _view(committed, job_id)["status"] == "failed"  # its only item failed
    assert node_statuses(sessions, job_id) == {"failed": 4}


def _unrelated(job_id: str) -> NodeMessage:
    return NodeMessage(job_id, 0, "elsewhere", 0, "t.engine", 6)


def test_an_expired_batch_job_ends_expired_not_cancelled(committed: Engine, host: LoopHost) -> None:
    from app.db import repository
    from app.jobs.batches.service import describe_batch

    sessions = make_session_factory(committed)
    dispatcher = ListDispatcher()
    job_id = submit(sessions, "review-compare", REVIEWS[:2])
    past = utcnow() - timedelta(seconds=1)
    with session_scope(sessions) as session:
        from app.db import Job

        session.execute(update(Job).where(Job.id == job_id).values(expires_at=past, kind="batch"))
        repository.create_batch(
            session, batch_id="batch_test1", owner="anonymous", endpoint="/v1/chat/completions",
            completion_window="24h", input_file_id="file_x", metadata=None, created_at=past, expires_at=past,
            job_id=job_id,
        )
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    assert sweep(sessions, dispatcher, ENDPOINTS, NodePolicy()).expired == 1
    with session_scope(sessions) as session:
        assert describe_batch(session, "batch_test1")["status"] == "expired"


def test_a_running_node_renews_its_lease_so_the_sweeper_leaves_it(committed: Engine, host: LoopHost) -> None:
    import threading

    sessions = make_session_factory(committed)
    lm = ScriptedLM(latency=1.5)
    dispatcher = ListDispatcher()
    policy = NodePolicy(lease_s=0.6, stale_s=5.0)  # renewed every 0.2 s while the 1.5 s call runs
    worker = make_worker(committed, dispatcher, lm, host, policy)
    job_id = submit(sessions, "review-compare", REVIEWS[:1])
    dispatch_job(sessions, job_id, dispatcher, ENDPOINTS)
    first = dispatcher.take()[0]
    outcome: list[Outcome] = []
    runner = threading.Thread(target=lambda: outcome.append(run_node(worker, call_of(first))))
    runner.start()
    reports = []
    for _ in range(5):
        time.sleep(0.25)
        reports.append(sweep(sessions, dispatcher, ENDPOINTS, policy))
    runner.join()
    assert outcome == [Outcome.STORED]
    assert all(r.requeued == 0 for r in reports)  # alive: its lease never lapsed
    assert len(lm.calls) == 1


def test_dispatch_starts_with_a_small_page_then_doubles(committed: Engine) -> None:
    """Workers get the first nodes before the whole job is written: pages of 32, 64, ... items, the dispatch
    window refilled as soon as each page commits; the broker gets at most the window, PostgreSQL keeps the rest,
    and every item's first nodes are sent exactly once as the window drains."""
    sessions = make_session_factory(committed)
    batches: list[int] = []

    class Recording(ListDispatcher):
        def send(self, messages: Sequence[NodeMessage]) -> None:
            batches.append(sum(m.nodes for m in messages))
            super().send(messages)

    dispatcher = Recording()
    window = DispatchWindow(sessions, dispatcher, WindowPolicy(window=80))
    items = [{"custom_id": f"r{i}", "input": f"review {i}"} for i in range(100)]
    job_id = submit(sessions, "review-compare", items)
    ready = dispatch_job(sessions, job_id, dispatcher, ENDPOINTS, page_size=50, window=window)
    assert ready == 2 * len(items)  # every item's two first nodes are ready in PostgreSQL
    assert batches == [2 * 32, 80 - 2 * 32]  # the first page, then the window's rest; nothing beyond it
    assert node_statuses(sessions, job_id) == {"queued": 2 * len(items), "waiting": 2 * len(items)}
    # workers take messages (claims free the window), and each refill sends no more than the room there is
    while dispatcher.take():
        with session_scope(sessions) as session:
            session.execute(update(NodeTask).where(NodeTask.job_id == job_id, NodeTask.sent_at.is_not(None),
                                                   NodeTask.status == "queued").values(status="running"))
        window.refill()
        assert batches[-1] <= 80
    keys = {(m.item_id, m.node_id) for m in dispatcher.sent}
    assert len(keys) == len(dispatcher.sent) == 2 * len(items)
