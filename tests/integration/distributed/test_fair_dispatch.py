"""Bounded, fair dispatch on real PostgreSQL, Redis and Celery workers: a small job of another tenant is not
held behind a big one, priority still comes first, the broker never holds more than the window, a big job's
cancel stops it within seconds, and a SIGKILLed worker loses nothing with the window in place. Concurrency is
proven by counts (how much of the big job had finished when the small one did), not by wall-clock bounds."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from app.db import make_session_factory, session_scope
from app.jobs.service import cancel_job
from tests.support.cluster import Cluster, wait_until

SENTIMENT_ITEMS = 400  # one call an item, 4 at once at 50 ms: about 5 s of work


def _items(prefix: str, n: int) -> list[dict[str, str]]:
    return [{"custom_id": f"{prefix}-{i:05d}", "input": f"review {i}: the battery lasts"} for i in range(n)]


def _completed(cluster: Cluster, job_id: str) -> int:
    return int(cluster.view(job_id)["counts"]["completed"])


def _limited(cluster: Cluster, **env: str) -> None:
    cluster.write_resources(max_concurrent=4)
    cluster.env.update(env)


def _big_job_under_way(cluster: Cluster) -> str:
    """Tenant acme's SENTIMENT_ITEMS-item job, once 20 of its items are done, on one worker of 16 threads."""
    _limited(cluster)
    cluster.start_worker("w1", "--pool", "threads", "--concurrency", "16")
    big = cluster.submit("sentiment", _items("a", SENTIMENT_ITEMS), owner="acme")
    wait_until(lambda: _completed(cluster, big) >= 20, 60, "the big job to get going")
    return big


@pytest.mark.timeout(240)
def test_a_small_job_of_another_tenant_is_not_held_behind_a_big_one(cluster: Cluster) -> None:
    big = _big_job_under_way(cluster)
    small = cluster.submit("sentiment", _items("b", 10), owner="beta")
    assert cluster.wait(small, 60)["status"] == "completed"
    done_by_then = _completed(cluster, big)
    # the small job took the next free slots: most of the big job was still to run when it finished
    assert done_by_then < SENTIMENT_ITEMS // 2, done_by_then
    assert cluster.wait(big, 180)["status"] == "completed"
    assert cluster.fake_stats()["total"] == SENTIMENT_ITEMS + 10  # every item called once


@pytest.mark.timeout(240)
def test_lower_priority_values_still_go_first(cluster: Cluster) -> None:
    big = _big_job_under_way(cluster)
    later = cluster.submit("sentiment", _items("later", 10), owner="beta", priority=5)
    urgent = cluster.submit("sentiment", _items("urgent", 10), owner="acme", priority=-1)
    assert cluster.wait(urgent, 60)["status"] == "completed"
    assert _completed(cluster, big) < SENTIMENT_ITEMS // 2  # the urgent job went ahead of the big one
    assert cluster.view(later)["counts"]["completed"] < 10  # a less urgent tenant waits, fair share or not
    assert cluster.wait(later, 180)["status"] == "completed"
    # the less urgent job ran only once the big job had nothing left to send: it finished after nearly all of it
    assert _completed(cluster, big) >= SENTIMENT_ITEMS - 40
    assert cluster.wait(big, 180)["status"] == "completed"


@pytest.mark.timeout(240)
def test_the_broker_never_holds_more_than_the_window(cluster: Cluster) -> None:
    _limited(cluster, INF_ENGINE_DISPATCH_WINDOW="6")
    cluster.start_worker("w1", "--pool", "threads", "--concurrency", "16")
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((cluster.queued_messages(), cluster.unclaimed_sent()))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        job = cluster.submit("sentiment", _items("a", 300), owner="acme")
        assert cluster.wait(job, 180)["status"] == "completed"
    finally:
        stop.set()
        sampler.join()
    assert len(samples) > 50
    assert max(messages for messages, _ in samples) <= 6, max(samples)
    assert max(sent for _, sent in samples) <= 6, max(samples)
    assert max(messages for messages, _ in samples) > 0  # the sampler did see the broker at work
    assert cluster.fake_stats()["total"] == 300
    assert cluster.node_counts(job) == {"done": 300}


@pytest.mark.timeout(240)
def test_cancelling_a_big_job_stops_it_within_seconds(cluster: Cluster) -> None:
    _limited(cluster)
    cluster.start_worker("w1", "--pool", "threads", "--concurrency", "16")
    cluster.start("beat")
    big = cluster.submit("sentiment", _items("a", 3000), owner="acme")
    wait_until(lambda: _completed(cluster, big) >= 20, 60, "the big job to get going")
    with session_scope(make_session_factory(cluster.engine)) as session:
        cancel_job(session, big)
    view = cluster.wait(big, 30)  # the API's loop or the sweeper settles it once its running nodes stop
    assert view["status"] == "cancelled", view
    calls = cluster.fake_stats()["total"]
    assert calls < 3000 // 2  # most of the job never ran
    time.sleep(1.0)
    assert cluster.fake_stats()["total"] <= calls + 16  # at most what the window and threads held, then nothing
    wait_until(lambda: cluster.queued_messages() == 0, 20, "the stale messages to be acknowledged")
    counts = cluster.node_counts(big)
    assert set(counts) <= {"done", "failed"} and counts.get("done", 0) == view["counts"]["completed"]


@pytest.mark.timeout(300)
def test_sigkill_with_a_small_window_loses_and_repeats_nothing(cluster: Cluster) -> None:
    _limited(cluster, INF_ENGINE_DISPATCH_WINDOW="4")
    cluster.start("beat")  # the sweeper re-queues the nodes the dead worker held (leases of 3 s)
    doomed = cluster.start_worker("doomed", "--pool", "threads", "--concurrency", "16")
    job = cluster.submit("sentiment", _items("a", 200), owner="acme")
    wait_until(lambda: _completed(cluster, job) >= 50, 120, "a quarter of the items")
    cluster.stop(doomed, signal.SIGKILL)
    cluster.start_worker("rescuer", "--pool", "threads", "--concurrency", "16")
    view = cluster.wait(job, 180)
    assert view["status"] == "completed" and view["counts"]["completed"] == 200
    states = cluster.item_states(job)
    assert sorted(q for _, _, q in states) == list(range(1, 201))  # each item finished exactly once
    assert cluster.node_counts(job) == {"done": 200}


@pytest.mark.timeout(240)
def test_a_tenants_in_flight_quota_caps_its_node_tasks_and_not_anothers(cluster: Cluster) -> None:
    _limited(cluster, INF_ENGINE_TENANT_QUOTAS='{"acme": {"max_inflight_nodes": 3}}')
    cluster.start_worker("w1", "--pool", "threads", "--concurrency", "16")
    capped = cluster.submit("sentiment", _items("a", 60), owner="acme")
    free = cluster.submit("sentiment", _items("b", 60), owner="beta")
    peaks = {"acme": 0, "beta": 0}
    while cluster.view(capped)["status"] != "completed" or cluster.view(free)["status"] != "completed":
        for tenant, job in (("acme", capped), ("beta", free)):
            peaks[tenant] = max(peaks[tenant], cluster.in_flight_of(job))
        time.sleep(0.02)
    assert 0 < peaks["acme"] <= 3, peaks
    assert peaks["beta"] > 3, peaks  # the other tenant is not held to acme's quota
    assert cluster.node_counts(capped) == {"done": 60} and cluster.node_counts(free) == {"done": 60}
