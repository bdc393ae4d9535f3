"""The migrations travel inside the package (importlib.resources) and upgrades hold an advisory lock (issue 17)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import app
from app.db.migrate import current_revision, head_revision, migrations_dir, upgrade
from app.db.session import database_url
from app.settings import Settings
from tests.support.postgres import temporary_database

ROOT = Path(__file__).resolve().parents[3]


def test_the_migrations_are_package_data_of_app_db() -> None:
    folder = migrations_dir()
    assert folder == Path(app.__file__).parent / "db" / "migrations"
    assert (folder / "env.py").is_file() and (folder / "alembic.ini").is_file()
    assert len(list((folder / "versions").glob("0*.py"))) >= 5
    # the top-level migrations/ folder (the project's fixed layout) is what the package links to
    assert (ROOT / "app" / "db" / "migrations").resolve() == (ROOT / "migrations").resolve()


def test_the_wheel_declares_the_migrations_as_package_data() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = project["tool"]["setuptools"]["package-data"]["app.db.migrations"]
    assert {"alembic.ini", "script.py.mako"} <= set(data)
    assert (ROOT / "app" / "db" / "migrations" / "__init__.py").is_file()
    assert (ROOT / "app" / "db" / "migrations" / "versions" / "__init__.py").is_file()


def test_db_upgrade_from_any_directory(tmp_path: Path) -> None:
    with temporary_database("infe_anydir") as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
        env["INF_ENGINE_DATABASE_URL"] = url
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", "db", "upgrade"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert current_revision(url) == head_revision(url)


def test_concurrent_upgrades_run_one_after_the_other() -> None:
    with temporary_database("infe_lock") as url:
        errors: list[BaseException] = []

        def migrate() -> None:
            try:
                upgrade(url)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=migrate) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert current_revision(url) == head_revision(url)


@pytest.mark.parametrize("password", ["plain", "p@ss:/%w"])
def test_database_password_is_kept_apart_from_the_url(password: str) -> None:
    settings = Settings(database_url="postgresql://inf@postgres:5432/inf", database_password=password)
    from sqlalchemy.engine import make_url

    url = make_url(database_url(settings))
    assert url.password == password and url.username == "inf" and url.drivername == "postgresql+psycopg"
    assert password not in repr(settings)
