"""A bad setting stops every command in one line on stderr, exit status 2, no traceback; list settings as users
write them (``INF_ENGINE_API_KEYS=my-key``) just work. Real processes, as a user starts them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def cli() -> list[str]:
    script = Path(sys.executable).with_name("inf-engine")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "app.cli"]


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    clean.update(INF_ENGINE_DATA_DIR=str(cwd / "data"), **env)
    return subprocess.run(args, cwd=cwd, env=clean, capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("command", [["db", "upgrade"], ["serve"], ["worker"], ["jobs", "list"]])
@pytest.mark.parametrize(
    ("env", "variable", "fix"),
    [
        ({"INF_ENGINE_SERVE_PORT": "abc"}, "INF_ENGINE_SERVE_PORT", "INF_ENGINE_SERVE_PORT=8000"),
        ({"INF_ENGINE_LOG_LEVEL": "LOUD"}, "INF_ENGINE_LOG_LEVEL", "DEBUG, INFO, WARNING, ERROR or CRITICAL"),
        ({"INF_ENGINE_CONFIG_FILE": "missing.toml"}, "INF_ENGINE_CONFIG_FILE", "unset it"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(
    tmp_path: Path, command: list[str], env: dict[str, str], variable: str, fix: str
) -> None:
    result = run([*cli(), *command], tmp_path, **env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert variable in lines[0] and fix in lines[0] and lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout


def test_celery_entry_point_fails_the_same_way(tmp_path: Path) -> None:
    result = run([sys.executable, "-m", "celery", "-A", "workers.celery_app", "inspect", "ping"], tmp_path,
                 INF_ENGINE_SERVE_PORT="abc")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "INF_ENGINE_SERVE_PORT" in result.stderr and "Traceback" not in result.stderr


def test_a_plain_api_key_no_longer_crashes_a_command(tmp_path: Path) -> None:
    result = run([*cli(), "db", "upgrade"], tmp_path, INF_ENGINE_API_KEYS="my-key")
    assert result.returncode == 0, result.stderr
    assert "now at revision" in result.stderr and (tmp_path / "data").is_dir()
    listed = run([*cli(), "db", "current"], tmp_path, INF_ENGINE_API_KEYS=" a , b ")
    assert listed.returncode == 0 and "head" in listed.stdout, listed.stderr


def test_help_needs_no_valid_settings(tmp_path: Path) -> None:
    result = run([*cli(), "serve", "--help"], tmp_path, INF_ENGINE_SERVE_PORT="abc")
    assert result.returncode == 0 and "Usage" in result.stdout


def test_a_pipeline_module_that_does_not_import_stops_serve_in_one_line(tmp_path: Path) -> None:
    result = run([*cli(), "serve"], tmp_path, INF_ENGINE_PIPELINE_MODULES="no_such_module_here")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "INF_ENGINE_PIPELINE_MODULES lists 'no_such_module_here'" in result.stderr.strip().splitlines()[-1]


def test_gguf_quantization_of_a_folder_model_stops_serve_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    result = run([*cli(), "serve", str(folder)], tmp_path, INF_ENGINE_QUANTIZATION="gguf")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "INF_ENGINE_QUANTIZATION=gguf runs a GGUF file's own 4-bit blocks" in last and "give a .gguf model" in last
