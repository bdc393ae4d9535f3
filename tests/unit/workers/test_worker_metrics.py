"""A worker's own /metrics: a real HTTP server on a free loopback port, read with a real GET and Prometheus' parser.

The engine here is its statistics object (``app.engine.metrics``, no torch); tests/unit/serving's
test_worker_engine_metrics.py drives a real tiny engine through the same endpoint.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from celery.signals import task_postrun, task_prerun, worker_shutdown
from prometheus_client.parser import text_string_to_metric_families

from app.engine.metrics import RequestMetrics, StatsCollector
from app.jobs.distributed.worker_metrics import MetricsServer, WorkerMetrics, worker_metrics
from app.serving.metrics import EngineSnapshot, InProcessEngineCollector
from app.settings import Settings
from workers.observability import serve_metrics

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(port: int, path: str = "/metrics") -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        assert response.status == 200
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return content_type, samples


def engine_stats() -> object:
    """An engine's statistics after two finished requests (what ``LLMEngine.get_stats()`` returns)."""
    collector = StatsCollector()
    for arrival, prompt, reason in ((0.0, 12, "stop"), (1.0, 20, "length")):
        metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=prompt)
        metrics.on_scheduled(arrival + 0.01)
        metrics.on_tokens(arrival + 0.05, 1)
        collector.record_first_token(metrics)
        itl = metrics.on_tokens(arrival + 0.08, 1)
        collector.record_step(2, [itl] if itl is not None else [])
        metrics.finished_time = arrival + 0.5
        collector.record_finished(metrics, [reason])
    return collector.snapshot(
        num_requests_running=3, num_requests_waiting=1, kv_cache_usage_perc=0.25, prefix_cache_queries=32,
        prefix_cache_hits=8, num_preemptions=0,
    )


@pytest.fixture
def server() -> Iterator[tuple[MetricsServer, WorkerMetrics]]:
    metrics = WorkerMetrics()
    metrics.registry.register(InProcessEngineCollector(lambda: [EngineSnapshot.of_engine("tiny", engine_stats())]))
    metrics.describe(role="engine", pool="threads", queues=["inf.engine"], slots=32)
    endpoint = MetricsServer(metrics.registry, "127.0.0.1", 0)  # a free port
    try:
        yield endpoint, metrics
    finally:
        endpoint.close()


def test_get_metrics_has_the_engines_vllm_series(server: tuple[MetricsServer, WorkerMetrics]) -> None:
    endpoint, _ = server
    assert endpoint.port > 0
    content_type, samples = scrape(endpoint.port)
    assert content_type.startswith("text/plain")
    labels = (("engine", "0"), ("model_name", "tiny"))
    assert samples["vllm:num_requests_running"] == {labels: 3}
    assert samples["vllm:num_requests_waiting"] == {labels: 1}
    assert samples["vllm:kv_cache_usage_perc"] == {labels: 0.25}
    assert samples["vllm:prefix_cache_queries_total"] == {labels: 32}
    assert samples["vllm:prefix_cache_hits_total"] == {labels: 8}
    assert samples["vllm:prompt_tokens_total"] == {labels: 32}
    assert samples["vllm:generation_tokens_total"] == {labels: 4}
    assert samples["vllm:request_success_total"] == {
        (("engine", "0"), ("finished_reason", reason), ("model_name", "tiny")): 1 for reason in ("length", "stop")
    }
    # histograms with vLLM's buckets, cumulative, +Inf = count
    ttft = {dict(k)["le"]: v for k, v in samples["vllm:time_to_first_token_seconds_bucket"].items()}
    assert ttft["0.04"] == 0 and ttft["0.06"] == 2
    assert ttft["+Inf"] == samples["vllm:time_to_first_token_seconds_count"][labels] == 2
    assert samples["vllm:e2e_request_latency_seconds_count"][labels] == 2
    assert abs(samples["vllm:e2e_request_latency_seconds_sum"][labels] - 1.0) < 1e-9
    assert samples["vllm:request_queue_time_seconds_count"][labels] == 2
    assert samples["vllm:inter_token_latency_seconds_count"][labels] == 2
    assert samples["inf_engine_prefix_cache_misses_total"] == {(*labels, ("policy", "lru")): 24}
    assert not any(name.endswith("_created") for name in samples)  # as vLLM


def test_get_metrics_has_the_workers_own_series(server: tuple[MetricsServer, WorkerMetrics]) -> None:
    endpoint, metrics = server
    metrics.task_started("inf.run_node")
    metrics.task_started("inf.run_node")
    metrics.task_finished("inf.run_node", "SUCCESS")
    metrics.node_finished("llm", 0.2)
    _, samples = scrape(endpoint.port)
    assert samples["inf_engine_worker_tasks_total"] == {(("state", "SUCCESS"), ("task", "inf.run_node")): 1}
    assert samples["inf_engine_worker_tasks_running"] == {(("task", "inf.run_node"),): 1}
    assert samples["inf_engine_worker_node_seconds_bucket"][(("kind", "llm"), ("le", "0.25"))] == 1
    assert samples["inf_engine_worker_task_slots"] == {(): 32}
    assert samples["inf_engine_worker_info"] == {
        (("pool", "threads"), ("queues", "inf.engine"), ("role", "engine")): 1
    }
    assert "process_resident_memory_bytes" in samples or "python_info" in samples


def test_no_engine_no_vllm_series() -> None:
    metrics = WorkerMetrics()
    metrics.registry.register(InProcessEngineCollector(lambda: []))  # the model loads on the first task

    def broken() -> list[EngineSnapshot]:
        raise RuntimeError("engine gone")

    metrics.registry.register(InProcessEngineCollector(broken))  # a scrape survives a failing engine
    endpoint = MetricsServer(metrics.registry, "127.0.0.1", 0)
    try:
        _, samples = scrape(endpoint.port)
    finally:
        endpoint.close()
    assert not any(name.startswith("vllm:") for name in samples)
    assert "inf_engine_worker_task_slots" in samples


class _Task:
    name = "inf.ping"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_metrics_follows_the_setting_and_counts_celery_tasks() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:6379/0")
    assert settings.worker_metrics_port is None
    assert serve_metrics(settings, role="worker", pool="threads", queues=["inf.cpu"], slots=4) is None  # off

    port = _free_port()
    settings = Settings(worker_metrics_port=port, worker_metrics_address="127.0.0.1")  # type: ignore[call-arg]
    endpoint = serve_metrics(settings, role="engine", pool="threads", queues=["inf.engine"], slots=8)
    assert endpoint is not None and endpoint.port == port
    try:
        task = _Task()
        before = worker_metrics().tasks.labels("inf.ping", "SUCCESS")._value.get()
        task_prerun.send(sender=task, task_id="t1", task=task, args=(), kwargs={})
        _, running = scrape(port)
        task_postrun.send(sender=task, task_id="t1", task=task, args=(), kwargs={}, retval=None, state="SUCCESS")
        _, samples = scrape(port)
    finally:
        worker_shutdown.send(sender=None)  # closes the server and disconnects the hooks
    assert running["inf_engine_worker_tasks_running"][(("task", "inf.ping"),)] == 1
    assert samples["inf_engine_worker_tasks_running"][(("task", "inf.ping"),)] == 0
    assert samples["inf_engine_worker_tasks_total"][(("state", "SUCCESS"), ("task", "inf.ping"))] == before + 1
    assert samples["inf_engine_worker_info"][(("pool", "threads"), ("queues", "inf.engine"), ("role", "engine"))] == 1
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)  # closed at shutdown


def test_a_taken_port_is_an_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = int(sock.getsockname()[1])
        settings = Settings(worker_metrics_port=port, worker_metrics_address="127.0.0.1")  # type: ignore[call-arg]
        with pytest.raises(OSError):
            serve_metrics(settings, role="worker", pool="threads", queues=["inf.cpu"], slots=4)
