"""Fixtures of the limit tests: a private Redis key prefix, async and sync clients, and worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from tests.support.redisdb import SERVER, client, temporary_prefix

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def prefix() -> Iterator[str]:
    with temporary_prefix("infe_limits") as name:
        yield name


@pytest.fixture
async def aredis() -> AsyncIterator[AsyncRedis]:
    client()  # a clear error when Redis is down
    conn = AsyncRedis.from_url(SERVER, max_connections=256)
    yield conn
    await conn.aclose()


@pytest.fixture
def sredis() -> Iterator[redis.Redis]:
    conn = client()
    yield conn
    conn.close()


def start_worker(mode: str, args: dict[str, Any]) -> subprocess.Popen[str]:
    """One limiter in its own process (its own interpreter and Redis connections), like a separate worker."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.jobs.limits.worker_proc", mode, json.dumps(args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result_of(proc: subprocess.Popen[str], timeout: float) -> Any:
    try:
        out, errors = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, errors
    return json.loads(out.strip().splitlines()[-1])
