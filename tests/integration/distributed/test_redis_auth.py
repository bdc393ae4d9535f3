"""The platform on a Redis that requires a password, as deploy/k8s runs it (requirepass from a Secret, every client's
INF_ENGINE_REDIS_URL carrying it): a worker, beat and the API's metrics work through the URL alone, and a client
without the password is refused."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from tests.integration.distributed.conftest import MakeCluster
from tests.support.cluster import free_port, wait_until
from tests.support.serving_fakes import FakeBackend


@pytest.fixture
def protected_redis(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A private redis-server with requirepass: (URL without the password, the password)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port, password = free_port(), secrets.token_hex(24)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password, "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: redis.Redis.from_url(url, password=password).ping(), 20, "the private redis-server")
        yield url, password
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_every_client_reaches_redis_through_its_url(make_cluster: MakeCluster,
                                                    protected_redis: tuple[str, str]) -> None:
    bare_url, password = protected_redis
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: no password, no broker
        redis.Redis.from_url(bare_url).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(bare_url.replace("//", "//:wrong@")).ping()

    # what the pods get: redis://:$(REDIS_PASSWORD)@redis:6379/0, expanded by the kubelet
    cluster = make_cluster(redis_url=bare_url.replace("//", f"//:{password}@"))
    cluster.start_worker("auth")  # waits for its answer to a ping over the protected broker
    cluster.start("beat")
    job_id = cluster.submit("review-compare", [{"custom_id": f"c{i}", "input": f"review {i}: fine"} for i in range(4)])
    assert cluster.wait(job_id, 90)["status"] == "completed"

    app = create_app(cluster.settings, backend=FakeBackend())
    with TestClient(app) as client:
        metrics = client.get("/metrics").text
    assert "inf_engine_metrics_leader 1.0" in metrics  # the leader lock lives in the protected Redis
    assert 'inf_engine_jobs{status="completed"} 1.0' in metrics
    protected = redis.Redis.from_url(bare_url, password=password)
    wait_until(lambda: protected.get(f"{cluster.prefix}:beat:lock"), 60, "beat's lock")  # beat holds it there
