"""Platform metrics: what workers record in Redis, and what the collector exports with the jobs table's counts."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from app.db.repository.platform_stats import job_status_counts
from app.jobs.distributed.monitoring import BufferedRecorder, ExportLeader, JobCounts, PlatformCollector
from app.jobs.submission import JobRequest, submit_job
from tests.support.redisdb import client, temporary_prefix


def _samples(collector: PlatformCollector) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry()
    registry.register(collector)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_worker_observations_and_queue_depths_reach_the_collector() -> None:
    redis = client()
    with temporary_prefix("infe_metrics") as prefix:
        recorder = BufferedRecorder(redis, prefix, interval_s=60)
        for seconds in (0.004, 0.03, 0.03, 2.0):
            recorder.node_finished("llm", seconds)
        recorder.node_finished("op", 0.001)
        recorder.rate_limit_wait("openai:gpt@http://x", 0.5)
        recorder.rate_limit_wait("openai:gpt@http://x", 0.25)
        recorder.flush()
        queue_key = f"{prefix}:celery:{prefix}.llm"
        redis.rpush(queue_key, b"m1", b"m2")
        redis.rpush(f"{queue_key}:3", b"m3")
        counts = JobCounts({"running": 2, "completed": 5}, {"completed": 40, "failed": 2, "cancelled": 0})
        collector = PlatformCollector(
            lambda: counts, lambda: redis, prefix,
            {f"{prefix}.llm": [queue_key, f"{queue_key}:3"], f"{prefix}.cpu": [f"{prefix}:celery:{prefix}.cpu"]},
            ["queued", "running", "completed"],
        )
        samples = _samples(collector)
    redis.close()
    assert samples["inf_engine_jobs"] == {(("status", "completed"),): 5, (("status", "queued"),): 0,
                                          (("status", "running"),): 2}
    assert samples["inf_engine_items_done_total"][(("status", "completed"),)] == 40
    assert samples["inf_engine_queue_depth"] == {(("queue", f"{prefix}.llm"),): 3, (("queue", f"{prefix}.cpu"),): 0}
    llm = (("kind", "llm"),)
    assert samples["inf_engine_node_latency_seconds_count"][llm] == 4
    assert abs(samples["inf_engine_node_latency_seconds_sum"][llm] - 2.064) < 1e-9
    buckets = samples["inf_engine_node_latency_seconds_bucket"]
    assert buckets[(("kind", "llm"), ("le", "0.005"))] == 1
    assert buckets[(("kind", "llm"), ("le", "0.05"))] == 3  # cumulative
    assert buckets[(("kind", "llm"), ("le", "+Inf"))] == 4
    endpoint = (("endpoint", "openai:gpt@http://x"),)
    assert samples["inf_engine_rate_limit_waits_total"][endpoint] == 2
    assert samples["inf_engine_rate_limit_wait_seconds_total"][endpoint] == 0.75


def test_a_scrape_survives_a_missing_database_and_redis() -> None:
    def down() -> None:
        raise ConnectionError("down")

    collector = PlatformCollector(lambda: None, down, "x", {"x.cpu": ["x:celery:x.cpu"]})  # type: ignore[arg-type]
    assert _samples(collector) == {"inf_engine_metrics_leader": {(): 1}}  # one process (no leader): it exports
    leader = ExportLeader(down, "x:metrics:leader")  # type: ignore[arg-type]
    collector = PlatformCollector(lambda: None, down, "x", {}, leader=leader)  # type: ignore[arg-type]
    assert _samples(collector) == {"inf_engine_metrics_leader": {(): 0}}  # nobody can tell who leads: nothing


def test_only_the_leading_replica_exports_the_cluster_wide_series() -> None:
    """Two API replicas scraped alike: the jobs, queues and node latencies appear once, and when the leader stops
    (or dies: its lock lapses) the other one takes over at its next scrape."""
    redis = client()
    with temporary_prefix("infe_leader") as prefix:
        counts = JobCounts({"running": 2}, {"completed": 7})
        key = f"{prefix}:metrics:leader"
        leaders = [ExportLeader(lambda: redis, key, ttl_s=1.5) for _ in range(2)]
        replicas = [PlatformCollector(lambda: counts, lambda: redis, prefix, {}, leader=leader) for leader in leaders]
        try:
            first, second = (_samples(replica) for replica in replicas)
            assert first["inf_engine_metrics_leader"] == {(): 1} and second["inf_engine_metrics_leader"] == {(): 0}
            assert first["inf_engine_jobs"][(("status", "running"),)] == 2
            assert "inf_engine_jobs" not in second and "inf_engine_items_done_total" not in second
            time.sleep(2.0)  # longer than the TTL: the leader's thread renewed it, so it still leads
            assert [_samples(r)["inf_engine_metrics_leader"][()] for r in replicas] == [1, 0]
            assert redis.get(key) == leaders[0].token.encode()

            replicas[0].close()  # the leader shuts down: the lock is freed at once
            assert redis.get(key) is None
            assert [_samples(r)["inf_engine_metrics_leader"][()] for r in reversed(replicas)] == [1, 0]
            assert _samples(replicas[1])["inf_engine_items_done_total"][(("status", "completed"),)] == 7

            leaders[1]._stop.set()  # the new leader dies without releasing: another takes over after the TTL
            time.sleep(2.0)
            assert _samples(replicas[0])["inf_engine_metrics_leader"] == {(): 1}
        finally:
            for replica in replicas:
                replica.close()
    redis.close()


def test_job_counts_group_jobs_by_status(db: Session) -> None:
    for _ in range(2):
        submit_job(db, JobRequest("review-compare", inputs=["a", "b", "c"]))
    jobs, items = job_status_counts(db)
    assert jobs == {"queued": 2}
    assert items == {"completed": 0, "failed": 0, "cancelled": 0}
