"""GET /ready on real PostgreSQL databases: 503 with one line saying why while the database is unreachable or its
schema is not at the Alembic head, 200 once it is; /health (liveness) stays 200 meanwhile."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from psycopg import sql

from api.main import create_app
from app.db.migrate import downgrade, head_revision, upgrade
from app.serving.backends.base import HealthStatus
from app.settings import Settings
from tests.support.postgres import SERVER, temporary_database
from tests.support.serving_fakes import FakeBackend

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"  # nothing listens on port 1


def _client(tmp_path: Path, url: str | None, **settings: Any) -> TestClient:
    config = Settings(database_url=url, data_dir=tmp_path / "data", **{"db_auto_upgrade": False, **settings})
    return TestClient(create_app(config, backend=FakeBackend()))


def _not_ready(response: Any) -> dict[str, Any]:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and error["param"] is None
    assert "\n" not in error["message"]
    return error


@pytest.fixture
def fresh_url() -> Iterator[str]:
    """A new, empty database: nothing migrated."""
    with temporary_database("infe_ready") as url:
        yield url


def test_a_database_never_migrated_is_not_ready_then_ready_once_upgraded(tmp_path: Path, fresh_url: str) -> None:
    head = head_revision()
    with _client(tmp_path, fresh_url) as api:
        error = _not_ready(api.get("/ready"))
        assert error["code"] == "schema_not_at_head"
        assert error["message"] == (
            f"the database schema is at revision base (empty), not at head {head}: run `inf-engine db upgrade`"
        )
        assert api.get("/health").status_code == 200  # liveness: restarting would not help
        upgrade(fresh_url)
        ready = api.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "ready", "database": {"revision": head, "head": head, "at_head": True}}


def test_a_database_behind_head_names_both_revisions(tmp_path: Path, fresh_url: str) -> None:
    upgrade(fresh_url)
    downgrade(fresh_url, "-1")
    with _client(tmp_path, fresh_url) as api:
        error = _not_ready(api.get("/ready"))
    behind = error["message"].split("revision ")[1].split(",")[0]
    assert behind not in {head_revision(), "base (empty)"}
    assert error["message"] == (
        f"the database schema is at revision {behind}, not at head {head_revision()}: run `inf-engine db upgrade`"
    )


def test_an_unreachable_database_is_not_ready_and_says_so_quickly(tmp_path: Path) -> None:
    with _client(tmp_path, UNREACHABLE) as api:
        started = time.monotonic()
        error = _not_ready(api.get("/ready"))
        assert time.monotonic() - started < 5
        assert api.get("/health").status_code == 200
    assert error["code"] == "database_unreachable"
    assert error["message"].startswith("the database is unreachable: ")
    assert "port 1" in error["message"]


def test_ready_is_open_like_health(tmp_path: Path, pg_url: str) -> None:
    with _client(tmp_path, pg_url, api_keys=["sk-ready"]) as api:
        assert api.get("/v1/models").status_code == 401
        assert api.get("/ready").status_code == 200


def test_an_unhealthy_engine_is_not_ready(tmp_path: Path, pg_url: str) -> None:
    backend = FakeBackend()
    config = Settings(database_url=pg_url, data_dir=tmp_path, db_auto_upgrade=False)
    with TestClient(create_app(config, backend=backend)) as api:
        backend.healthy = HealthStatus(False, "the engine loop died")
        error = _not_ready(api.get("/ready"))
    assert error["code"] == "engine_unhealthy" and error["message"] == "the engine loop died"


def test_sqlite_not_created_yet_is_ready_only_when_the_server_creates_it(tmp_path: Path) -> None:
    with _client(tmp_path, None, db_auto_upgrade=True) as api:
        ready = api.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["database"]["revision"] is None
    assert not (tmp_path / "data").exists()  # the check created nothing
    with _client(tmp_path, None) as api:  # no auto-upgrade: the first job would fail
        assert _not_ready(api.get("/ready"))["code"] == "schema_not_at_head"


def test_a_server_that_migrates_itself_gets_ready_when_its_database_appears(tmp_path: Path) -> None:
    """db_auto_upgrade (the default): the database is missing at start, so the start fails; /ready says why, and
    once the database exists the readiness check restarts the jobs runtime, which migrates it."""
    name = f"infe_ready_late_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = f"{SERVER}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        with _client(tmp_path, url, db_auto_upgrade=True) as api:
            api.app.state.readiness.retry_every_s = 0.0
            error = _not_ready(api.get("/ready"))
            assert error["code"] == "database_unreachable" and f'"{name}" does not exist' in error["message"]
            with psycopg.connect(f"{SERVER}/postgres", autocommit=True) as admin:
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            deadline = time.monotonic() + 60
            while (ready := api.get("/ready")).status_code != 200:
                assert time.monotonic() < deadline, ready.text
                time.sleep(0.2)
            assert ready.json()["database"]["at_head"] is True
    finally:
        with psycopg.connect(f"{SERVER}/postgres", autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
