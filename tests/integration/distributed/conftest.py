"""Fixtures of the distributed tests: a migrated PostgreSQL database, a Redis key prefix, the fake OpenAI server
(its own process, 50 ms per call) and a :class:`Cluster` that starts workers and beat against them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from app.db.migrate import upgrade
from app.testing.fake_llm_server import start_fake_server_process, stop_fake_server_process
from tests.support.cluster import Cluster
from tests.support.postgres import temporary_database
from tests.support.redisdb import SERVER, client, temporary_prefix

MakeCluster = Callable[..., Cluster]


@pytest.fixture
def fake_endpoint() -> Iterator[str]:
    proc, base_url = start_fake_server_process(latency=0.05)
    try:
        yield base_url
    finally:
        stop_fake_server_process(proc)


@pytest.fixture
def make_cluster(tmp_path: Path, fake_endpoint: str) -> Iterator[MakeCluster]:
    """``make_cluster(db_url=None, redis_url=None, **env)``: a Cluster on the shared servers (a fresh database
    and key prefix) unless other URLs are given; everything is stopped and dropped at the end."""
    with ExitStack() as stack:

        def make(db_url: str | None = None, redis_url: str | None = None, **env: str) -> Cluster:
            if db_url is None:
                db_url = stack.enter_context(temporary_database("infe_dist"))
            if redis_url is None:
                client().close()  # a clear error when Redis is down
                redis_url = SERVER
            prefix = stack.enter_context(temporary_prefix("infe_dist")) if redis_url == SERVER else "infe_dist"
            upgrade(db_url)
            run = Cluster(tmp_path, db_url, redis_url, prefix, fake_endpoint, **env)
            stack.callback(run.close)
            return run

        yield make


@pytest.fixture
def cluster(make_cluster: MakeCluster) -> Cluster:
    return make_cluster()
