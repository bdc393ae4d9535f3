"""Issue 17 from the command line: --version, `serve MODEL --api-key` (flags over settings), one line instead of
a traceback when an extra is missing (torch, Flower) or kombu lacks what we patch, and scripts/services.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from app.cli import app
from app.version import version
from tests.support.cluster import free_port
from tests.support.server_helpers import build_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(extra)
    return env


def _blocked(modules: list[str], *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a process where ``modules`` cannot be imported (as if their extra were not installed)."""
    code = (
        "import sys\n"
        f"for name in {modules!r}: sys.modules[name] = None\n"
        f"sys.argv = ['inf-engine', *{list(args)!r}]\n"
        "from app.cli import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=120
    )


def test_version_flag_prints_the_installed_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"inf-engine {version()}"


def test_version_needs_no_valid_settings() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "--version"], cwd=ROOT, env=_env(INF_ENGINE_SERVE_PORT="nope"),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == f"inf-engine {version()}"


@pytest.mark.parametrize(
    ("args", "command"),
    [(["serve"], "serve"), (["run", "sentiment", "--input", "{input}"], "run"), (["worker", "--engine"], "worker")],
)
def test_commands_that_need_torch_say_so_in_one_line(args: list[str], command: str, tmp_path: Path) -> None:
    items = tmp_path / "items.jsonl"
    items.write_text('"I love it"\n')
    args = [a.replace("{input}", str(items)) for a in args]
    env = _env(INF_ENGINE_REDIS_URL="redis://127.0.0.1:6379/0", INF_ENGINE_DATA_DIR=str(tmp_path))
    done = _blocked(["torch"], *args, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "pip install 'inf-engine[engine]'" in lines[0] and command in lines[0] and "torch" in lines[0]


def test_serve_with_a_remote_backend_needs_no_torch() -> None:
    # the openai backend calls a server: it starts without torch (and fails later only for its own settings)
    done = _blocked(["torch"], "serve", "--backend", "openai")
    assert "inf-engine[engine]" not in done.stderr


def test_a_missing_engine_module_deep_in_a_command_is_one_line_too() -> None:
    done = _blocked(["transformers"], "serve", "--backend", "transformers", "--model", str(ROOT))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "inf-engine[engine]" in done.stderr


def test_flower_without_its_extra_says_so() -> None:
    env = _env(INF_ENGINE_REDIS_URL="redis://127.0.0.1:6379/0", INF_ENGINE_FLOWER_PASSWORD="pw")
    done = _blocked(["flower"], "flower", env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: `inf-engine flower` needs Flower, which is not installed: pip install 'inf-engine[flower]'"
    ]


def test_serve_model_argument_and_model_option_must_agree(tmp_path: Path) -> None:
    result = runner.invoke(app, ["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b")])
    assert result.exit_code == 2
    assert "differ" in result.stderr
    missing = runner.invoke(app, ["serve", str(tmp_path / "nowhere.gguf")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_serve_model_and_api_key_like_vllm(tmp_path: Path) -> None:
    """`inf-engine serve MODEL --api-key K`: the flag replaces INF_ENGINE_API_KEYS, the rest of the settings stay."""
    model = build_tiny_llama(tmp_path / "tiny-llama")
    port = free_port()
    env = _env(INF_ENGINE_API_KEYS=json.dumps(["sk-from-settings"]), INF_ENGINE_NUM_THREADS="1",
               INF_ENGINE_DATA_DIR=str(tmp_path), INF_ENGINE_SERVE_PORT=str(port))
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", str(model), "--api-key", "sk-flag", "--api-key", "acme:sk-2"],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"  # the port from the settings: no flag overrode it
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        models = lambda key: httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)  # noqa: E731
        assert models("sk-flag").status_code == 200
        assert models("sk-2").status_code == 200
        assert models("sk-from-settings").status_code == 401
        assert models("sk-flag").json()["data"][0]["id"] == "tiny-llama"
        assert httpx.get(f"{base}/version", timeout=5).json() == {"version": version()}
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert any(line["msg"].startswith("serving 'tiny-llama'") and line["service"] == "serve" for line in lines)
    requests = [line for line in lines if line["logger"] == "inf_engine.access"]
    assert requests and all(line["request_id"] for line in requests)


def test_kombu_without_the_patched_attributes_is_one_clear_error() -> None:
    from app.jobs.distributed.transport.redis_clients import KombuIncompatibleError, check_kombu

    check_kombu()  # the installed kombu has them all

    class OldChannel:
        def conn_or_acquire(self) -> None: ...

    with pytest.raises(KombuIncompatibleError) as caught:
        check_kombu(OldChannel)
    import kombu

    message = str(caught.value)
    assert f"kombu {kombu.__version__} is not supported" in message and "_create_client" in message


def test_services_script_names_what_is_missing_in_one_line() -> None:
    done = subprocess.run(
        ["/bin/bash", str(ROOT / "scripts" / "services.sh")], env={"PATH": "/nonexistent"},
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "PostgreSQL" in lines[0] and "Redis" in lines[0] and "not installed" in lines[0]


def test_services_script_is_quiet_when_both_run() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "services.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
