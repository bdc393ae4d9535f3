"""Throw-away Redis key spaces for tests: a unique prefix per test, whose keys are deleted at the end.

The server is the one CI starts (127.0.0.1:6379); ``INF_ENGINE_TEST_REDIS`` may name another.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

SERVER = os.environ.get("INF_ENGINE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def client() -> redis.Redis:
    conn = redis.Redis.from_url(SERVER, socket_connect_timeout=5)
    try:
        conn.ping()
    except redis.ConnectionError as exc:
        raise RuntimeError(
            f"Redis is not reachable at {SERVER} ({exc}); start it (.ci/run does) or set INF_ENGINE_TEST_REDIS"
        ) from exc
    return conn


def delete_prefix(conn: redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` (including Celery's, which it prefixes the same way)."""
    keys = list(conn.scan_iter(match=f"{prefix}*", count=1000))
    return int(conn.delete(*keys)) if keys else 0  # type: ignore[arg-type]


@contextmanager
def temporary_prefix(name: str = "infe_test") -> Iterator[str]:
    """A prefix no other test (or concurrent test run) uses; its keys are gone afterwards."""
    prefix = f"{name}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    conn = client()
    try:
        yield prefix
    finally:
        delete_prefix(conn, prefix)
        conn.close()
