"""The whole distributed path from the user's side: ``POST /v1/jobs`` on a server with Redis configured sends
the job's nodes to Celery workers; results stream back over HTTP, ``/metrics`` shows the platform's
``inf_engine_*`` series, and Flower shows the worker and the node tasks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.main import create_app
from tests.support.cluster import Cluster, free_port, wait_until
from tests.support.serving_fakes import FakeBackend

FLOWER_AUTH = ("flower", "s3cret")


@pytest.fixture
def client(cluster: Cluster) -> Iterator[TestClient]:
    app = create_app(cluster.settings.model_copy(update={"jobs_poll_interval": 0.2}), backend=FakeBackend())
    with TestClient(app) as test_client:
        yield test_client


def _wait(client: TestClient, job_id: str, statuses: set[str], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if view["status"] in statuses:
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.1)


def _metrics(client: TestClient) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_jobs_over_http_run_on_workers_with_metrics_and_flower(cluster: Cluster, client: TestClient) -> None:
    cluster.write_resources(rate_limit=900)  # 15 calls a second shared by all workers: some requests wait
    cluster.env.update(INF_ENGINE_FLOWER_USER=FLOWER_AUTH[0], INF_ENGINE_FLOWER_PASSWORD=FLOWER_AUTH[1])
    port = free_port()
    cluster.start("flower", "--port", str(port))
    name = f"w1.{cluster.prefix}@localhost"
    cluster.start_worker("w1")
    inputs = [{"custom_id": f"doc-{i}", "input": f"review {i}: warm sound"} for i in range(8)]

    created = client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": inputs})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    view = _wait(client, job_id, {"completed", "failed"})
    assert view["status"] == "completed", view
    lines = [line for line in client.get(f"/v1/jobs/{job_id}/results").text.splitlines() if line]
    assert len(lines) == 8

    def metrics_flushed() -> dict[str, Any] | None:  # workers write their observations once a second
        samples = _metrics(client)
        counts = samples.get("inf_engine_node_latency_seconds_count", {})
        return samples if counts.get((("kind", "llm"),)) == 24 else None

    samples = wait_until(metrics_flushed, 10, "the workers' metrics")
    assert samples["inf_engine_jobs"][(("status", "completed"),)] == 1
    assert samples["inf_engine_jobs"][(("status", "running"),)] == 0
    assert samples["inf_engine_items_done_total"][(("status", "completed"),)] == 8
    assert samples["inf_engine_node_latency_seconds_count"][(("kind", "llm"),)] == 24
    queues = {dict(labels)["queue"] for labels in samples["inf_engine_queue_depth"]}
    assert queues == {f"{cluster.prefix}.{kind}" for kind in ("cpu", "llm", "engine")}
    waits = samples["inf_engine_rate_limit_waits_total"]
    assert sum(waits.values()) > 0 and all("openai:fake-model@" in dict(k)["endpoint"] for k in waits)

    base = f"http://127.0.0.1:{port}"
    workers = wait_until(
        lambda: httpx.get(f"{base}/api/workers", params={"refresh": 1}, auth=FLOWER_AUTH, timeout=10).json(),
        60, "the worker in Flower",
    )
    assert name in workers

    def node_tasks() -> dict[str, Any] | None:
        tasks = httpx.get(f"{base}/api/tasks", params={"taskname": "inf.run_node"}, auth=FLOWER_AUTH,
                          timeout=10).json()
        mine = {k: v for k, v in tasks.items() if k.startswith(job_id)}
        # a message per extraction; the verdict they make ready runs in the delivery that stored the second one
        # (settings.node_local_chain), so 16 task messages carried the 24 nodes counted in the metrics above
        return mine if len(mine) == 16 else None

    tasks = wait_until(node_tasks, 30, "the job's 16 node-task messages in Flower")
    assert {t["state"] for t in tasks.values()} == {"SUCCESS"}
    assert {t["worker"] for t in tasks.values()} == {name}
    assert {t["result"] for t in tasks.values()} == {"'stored'"}


def test_cancel_over_http_finishes_the_job_on_workers(cluster: Cluster, client: TestClient) -> None:
    cluster.fake_control(latency=0.5)
    cluster.start_worker("w1", "--pool", "threads", "--concurrency", "4")
    inputs = [{"custom_id": f"doc-{i}", "input": f"review {i}"} for i in range(30)]
    job_id = client.post("/v1/jobs", json={"pipeline": "review-compare", "inputs": inputs}).json()["id"]
    wait_until(lambda: cluster.fake_stats()["total"] >= 2, 30, "the first calls")
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    view = _wait(client, job_id, {"cancelled"}, timeout=30)
    assert view["counts"]["cancelled"] > 0
    assert cluster.fake_stats()["total"] < 3 * 30
