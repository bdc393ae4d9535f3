"""``inf-engine db check`` on real PostgreSQL databases, as init containers run it: exit 0 at head, exit 2 with one
line otherwise (unreachable, or behind: run `inf-engine db upgrade`), and ``--wait`` waits for the schema."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from app.cli.console import EXIT_BAD_INPUT
from app.db.migrate import head_revision, upgrade
from tests.support.postgres import temporary_database


def _env(url: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(INF_ENGINE_DATABASE_URL=url, INF_ENGINE_DATA_DIR=str(tmp_path / "data"))
    return env


def _check(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "db", "check", *args], cwd=tmp_path, env=_env(url, tmp_path),
        capture_output=True, text=True, timeout=120,
    )


def test_db_check_fails_in_one_line_until_upgraded(tmp_path: Path) -> None:
    head = head_revision()
    with temporary_database("infe_dbcheck") as url:
        before = _check(url, tmp_path)
        assert before.returncode == EXIT_BAD_INPUT == 2, before.stderr
        (line,) = before.stderr.splitlines()
        assert line.startswith("error: postgresql+psycopg://postgres@")
        assert line.endswith(f"the database schema is at revision base (empty), not at head {head}: "
                             "run `inf-engine db upgrade`")
        assert before.stdout == ""
        upgrade(url)
        after = _check(url, tmp_path)
        assert after.returncode == 0, after.stderr
        assert after.stdout.strip().endswith(f": at head {head}")


def test_db_check_on_an_unreachable_database(tmp_path: Path) -> None:
    done = _check("postgresql://postgres@127.0.0.1:1/nowhere", tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "the database is unreachable: " in line and "port 1" in line


def test_db_check_on_sqlite_creates_nothing(tmp_path: Path) -> None:
    env = _env("", tmp_path)
    del env["INF_ENGINE_DATABASE_URL"]
    done = subprocess.run([sys.executable, "-m", "app.cli", "db", "check"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not at head" in done.stderr
    assert not (tmp_path / "data").exists()


def test_db_check_wait_returns_once_another_process_migrated(tmp_path: Path) -> None:
    """What the workers' and beat's init containers do while the API's init container migrates."""
    with temporary_database("infe_dbwait") as url:
        waiting = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "db", "check", "--wait", "90"], cwd=tmp_path,
            env=_env(url, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            time.sleep(3)
            assert waiting.poll() is None, waiting.communicate()
            upgrade(url)
            out, err = waiting.communicate(timeout=60)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.communicate()
        assert waiting.returncode == 0, err
        assert out.strip().endswith(f"at head {head_revision()}")
        assert err.splitlines() == [err.splitlines()[0]] and err.startswith("waiting: ")  # said once, not per try


def test_db_check_wait_gives_up_with_the_reason(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _check("postgresql://postgres@127.0.0.1:1/nowhere", tmp_path, "--wait", "3")
    assert done.returncode == 2 and time.monotonic() - started < 30
    lines = done.stderr.splitlines()
    assert lines[0].startswith("waiting: ") and lines[-1].startswith("error: ") and "unreachable" in lines[-1]
