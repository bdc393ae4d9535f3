"""Jobs on real Celery workers: every node a task, results in PostgreSQL, cancel stops the dispatch."""

from __future__ import annotations

import time

from tests.support.cluster import Cluster, wait_until


def test_a_job_runs_on_a_worker_one_task_per_node(cluster: Cluster) -> None:
    worker = cluster.start_worker("w1")
    inputs = [{"custom_id": f"c{i}", "input": f"review {i}: loud and clear"} for i in range(20)]
    job_id = cluster.submit("review-compare", inputs)
    view = cluster.wait(job_id, 90)
    assert view["status"] == "completed", view
    assert cluster.node_counts(job_id) == {"done": 4 * 20}
    states = cluster.item_states(job_id)
    assert {s for _, s, _ in states} == {"completed"}
    assert sorted(q for _, _, q in states) == list(range(1, 21))  # each item finished exactly once
    assert cluster.fake_stats()["total"] == 3 * 20  # one call per LLM node, the render op ran inline
    assert worker.poll() is None


def test_cancel_stops_dispatching_further_nodes(cluster: Cluster) -> None:
    cluster.fake_control(latency=0.5)
    cluster.start_worker("w1", "--pool", "threads", "--concurrency", "4")
    inputs = [{"custom_id": f"c{i}", "input": f"review {i}"} for i in range(40)]
    job_id = cluster.submit("review-compare", inputs)
    wait_until(lambda: cluster.fake_stats()["total"] >= 4, 30, "the first calls")
    from app.db import make_session_factory, session_scope
    from app.jobs.service import cancel_job

    with session_scope(make_session_factory(cluster.engine)) as session:
        cancel_job(session, job_id)
    calls_at_cancel = cluster.fake_stats()["total"]
    view = cluster.wait(job_id, 60)
    assert view["status"] == "cancelled", view
    time.sleep(1.5)  # anything still queued is delivered now, and must not call the endpoint
    # at most the nodes that were running when the job was cancelled finish their call
    assert cluster.fake_stats()["total"] <= calls_at_cancel + 4
    counts = cluster.node_counts(job_id)
    assert set(counts) <= {"done", "failed"}, counts
    assert {s for _, s, _ in cluster.item_states(job_id)} <= {"completed", "cancelled"}


def test_429s_slow_every_worker_down_and_nothing_fails(cluster: Cluster) -> None:
    cluster.write_resources(rate_limit=1200)  # we think 20 requests a second are fine...
    cluster.fake_control(rpm=240, retry_after=0.5)  # ...the server allows 4, and says so with 429s
    cluster.start_worker("a", "--pool", "threads", "--concurrency", "8")
    cluster.start_worker("b", "--pool", "threads", "--concurrency", "8")
    inputs = [{"custom_id": f"c{i}", "input": f"review {i}"} for i in range(10)]
    job_id = cluster.submit("review-compare", inputs)
    view = cluster.wait(job_id, 120)
    assert view["status"] == "completed" and view["counts"]["completed"] == 10, view
    stats = cluster.fake_stats()
    assert stats["by_status"]["200"] == 30
    rejected = stats["by_status"].get("429", 0)
    assert 0 < rejected < 30  # the shared limit came down after the first 429s instead of every worker hammering
