"""The migrations go up and down cleanly on PostgreSQL and SQLite, and head matches the models exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from app.db import Base, create_db_engine
from app.db.migrate import current_revision, downgrade, head_revision, upgrade
from tests.support.postgres import temporary_database

TABLES = {
    "pipelines", "graph_nodes", "jobs", "items", "node_results", "job_metrics", "parameter_versions", "files",
    "batches",
    "trainings", "training_steps", "evaluations", "evaluation_schedules", "feedback_requests",
    "node_tasks",
}


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'migrations.db'}"
    else:
        with temporary_database("infe_migrations") as pg:
            yield pg


def _tables(url: str) -> set[str]:
    engine = create_db_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(url: str) -> None:
    upgrade(url)
    assert _tables(url) == TABLES
    assert current_revision(url) == head_revision(url)
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert diff == [], f"the models and the migrations differ: {diff}"
    finally:
        engine.dispose()
    downgrade(url, "base")
    assert _tables(url) == set()
    assert current_revision(url) is None
    upgrade(url)
    assert _tables(url) == TABLES


def test_cli_db_upgrade_and_downgrade(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from app.cli import app
    from app.settings import get_settings

    monkeypatch.setenv("INF_ENGINE_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        result = runner.invoke(app, ["db", "upgrade"])
        assert result.exit_code == 0, result.output
        assert _tables(url) == TABLES
        result = runner.invoke(app, ["db", "current"])
        assert result.exit_code == 0 and head_revision(url) in result.output
        result = runner.invoke(app, ["db", "downgrade", "base"])
        assert result.exit_code == 0, result.output
        assert _tables(url) == set()
    finally:
        get_settings.cache_clear()
