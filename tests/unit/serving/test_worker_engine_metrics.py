"""An engine worker's /metrics on a real engine: a node call through the in-process engine client (what an
``--engine`` worker's tasks run), then a real GET of the worker's metrics endpoint on a free loopback port."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from app.jobs.distributed.worker_metrics import MetricsServer, WorkerMetrics
from app.pipeline.resources import EndpointConfig, LLMRequest
from app.serving.embedded import EmbeddedEngineClient, embedded_engines, get_embedded_engine
from tests.support.server_helpers import build_tiny_llama

pytest.importorskip("torch")

ENGINE_OPTIONS = {"warmup": False, "kv_cache_memory_bytes": 16 << 20, "seed": 0, "num_threads": 1}


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def test_the_engine_workers_metrics_count_a_node_call(tmp_path: Path) -> None:
    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    engine = get_embedded_engine(model, **ENGINE_OPTIONS)
    metrics = WorkerMetrics()
    metrics.host_engines()
    endpoint = MetricsServer(metrics.registry, "127.0.0.1", 0)
    client = EmbeddedEngineClient(EndpointConfig("native", model), engine=engine)
    try:
        before = _scrape(endpoint.port)
        response = await client.complete(
            LLMRequest(prompt="the quick brown fox", temperature=0.0, max_tokens=5, extra_body={"ignore_eos": True})
        )
        labels = (("engine", str(embedded_engines().index(engine))), ("model_name", "tiny-llama"))
        after = _scrape(endpoint.port)
    finally:
        await client.aclose()
        endpoint.close()
    assert labels not in before.get("vllm:prompt_tokens_total", {})  # no series before the engine first ran
    assert after["vllm:prompt_tokens_total"][labels] == response.input_tokens > 0
    assert after["vllm:generation_tokens_total"][labels] == response.output_tokens == 5
    assert after["vllm:request_success_total"][(*labels[:1], ("finished_reason", "length"), *labels[1:])] == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"vllm:{histogram}_count"][labels] == 1, histogram
    assert after["vllm:inter_token_latency_seconds_count"][labels] == 4
    assert after["vllm:num_requests_running"][labels] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc"][labels] <= 1
    assert after["vllm:prefix_cache_queries_total"][labels] >= response.input_tokens
