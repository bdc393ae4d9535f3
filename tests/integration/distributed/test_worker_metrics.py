"""``inf-engine worker --engine`` with INF_ENGINE_WORKER_METRICS_PORT: the worker process serves its own /metrics
(the engine's vllm:* series and its tasks'), read with a real GET after it ran a job's LLM nodes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster import Cluster, free_port, wait_until

pytest.importorskip("torch")


def _samples(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


@pytest.mark.timeout(600)
def test_an_engine_worker_serves_its_engines_metrics(cluster: Cluster, tmp_path: Path) -> None:
    from tests.support.server_helpers import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny-llama")
    cluster.resources.unlink()  # every alias is the worker's own in-process engine
    del cluster.env["INF_ENGINE_RESOURCES_FILE"]
    port = free_port()
    cluster.env.update(INF_ENGINE_MODEL=str(model), INF_ENGINE_NUM_THREADS="1",
                       INF_ENGINE_WORKER_METRICS_PORT=str(port), INF_ENGINE_WORKER_METRICS_ADDRESS="127.0.0.1")
    cluster.start_worker("metrics", "--engine", "--concurrency", "4")

    idle = _samples(port)  # up before any task: the worker's own series, no engine yet (it loads on first use)
    assert idle["inf_engine_worker_info"] == {
        (("pool", "threads"), ("queues", f"{cluster.prefix}.cpu,{cluster.prefix}.llm,{cluster.prefix}.engine"),
         ("role", "engine")): 1,
    }
    assert idle["inf_engine_worker_task_slots"] == {(): 4}
    assert not any(name.startswith("vllm:") for name in idle)

    inputs = [{"custom_id": f"note-{i}", "input": f"Write note {i} about the sea."} for i in range(3)]
    job_id = cluster.submit("tests.support.pipelines:OneCall", inputs)
    view = cluster.wait(job_id, 300)
    assert view["status"] == "completed", view

    samples = wait_until(lambda: (s := _samples(port)).get("inf_engine_worker_node_seconds_count") and s, 30,
                         "the node tasks in the worker's metrics")
    labels = (("engine", "0"), ("model_name", "tiny-llama"))
    assert samples["vllm:generation_tokens_total"][labels] == 3 * 128 == view["usage"]["output_tokens"]
    assert samples["vllm:prompt_tokens_total"][labels] == view["usage"]["input_tokens"]
    assert samples["vllm:request_success_total"][(labels[0], ("finished_reason", "length"), labels[1])] == 3
    assert samples["vllm:e2e_request_latency_seconds_count"][labels] == 3
    assert samples["vllm:num_requests_running"][labels] == 0
    assert sum(samples["inf_engine_worker_node_seconds_count"].values()) >= 3
    finished = samples["inf_engine_worker_tasks_total"]
    assert sum(v for k, v in finished.items() if dict(k) == {"task": "inf.run_node", "state": "SUCCESS"}) >= 1
