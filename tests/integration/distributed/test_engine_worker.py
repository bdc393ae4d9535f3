"""An engine worker (``inf-engine worker --engine``) hosts one engine per process and feeds it from many task
threads at once, so its continuous batching decodes concurrent node tasks together."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.cluster import Cluster

pytest.importorskip("torch")

ITEMS = 32
PIPELINE = "tests.support.pipelines:OneCall"


def _makespan(cluster: Cluster, items: int, tag: str) -> float:
    inputs = [{"custom_id": f"{tag}-{i}", "input": f"Write a short note number {i} about the sea."}
              for i in range(items)]
    start = time.perf_counter()
    job_id = cluster.submit(PIPELINE, inputs)
    view = cluster.wait(job_id, 300, interval=0.02)  # a makespan of ~0.3 s: look often, or the poll is what we time
    elapsed = time.perf_counter() - start
    assert view["status"] == "completed" and view["counts"]["completed"] == items, view
    assert view["usage"]["output_tokens"] == 128 * items
    return elapsed


@pytest.mark.timeout(600)
def test_concurrent_items_share_one_engine_batch(cluster: Cluster, tmp_path: Path) -> None:
    from tests.support.server_helpers import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny-llama")
    cluster.resources.unlink()  # no resources file: every alias is the worker's own in-process engine
    del cluster.env["INF_ENGINE_RESOURCES_FILE"]
    cluster.env.update(INF_ENGINE_MODEL=str(model), INF_ENGINE_NUM_THREADS="1")

    one_by_one = cluster.start_worker("serial", "--engine", "--concurrency", "1")
    _makespan(cluster, 1, "warm-serial")  # load the weights before timing
    serial = _makespan(cluster, ITEMS, "serial")
    cluster.stop(one_by_one)

    cluster.start_worker("batched", "--engine", "--concurrency", str(ITEMS))
    _makespan(cluster, 1, "warm-batched")
    # best of two: the batched makespan is about 0.3 s, so one scheduling hiccup of the 2-core host (seen once
    # in CI: 0.53 s) can halve the ratio; the serial one (~1.5 s) only gets slower from noise
    batched = min(_makespan(cluster, ITEMS, "batched"), _makespan(cluster, ITEMS, "batched-again"))
    print(f"{ITEMS} single-node items on one engine worker: one by one {serial:.2f} s, concurrently {batched:.2f} s "
          f"({serial / batched:.1f}x)")
    assert batched < serial / 3
