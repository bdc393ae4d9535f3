"""The vllm backend's process management, with a stand-in for vLLM's server (no vLLM needed).

The stand-in is a script given as ``python``: it ignores ``-m vllm.entrypoints.openai.api_server`` and
serves the fake OpenAI server plus ``/health`` on the ``--port`` it is handed.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from app.engine.core.sampling_params import SamplingParams
from app.serving.backends.base import BackendUnavailableError, GenerationRequest
from app.serving.backends.vllm import VLLMBackend

STUB = textwrap.dedent(
    """
    import argparse, asyncio, signal, sys
    from aiohttp import web
    from app.testing.fake_llm_server import FakeBehaviour, build_app

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--served-model-name"); p.add_argument("--model")
    p.add_argument("--host"); p.add_argument("--mode", default="ok")
    args, _ = p.parse_known_args(sys.argv[3:])  # argv[1:3] is "-m vllm.entrypoints.openai.api_server"
    if args.mode == "crash":
        print("pretend vLLM failed: CUDA out of memory", flush=True)
        sys.exit(3)
    if args.mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    app = build_app(behaviour=FakeBehaviour(model=args.served_model_name))

    async def health(_):
        return web.Response(text="")

    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, handle_signals=args.mode != "stubborn")
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    stub = tmp_path / "fake_vllm.py"
    stub.write_text(STUB)
    exe = tmp_path / "python"
    root = Path(__file__).resolve().parents[4]
    exe.write_text(f'#!/bin/sh\ncd {root} && exec {sys.executable} {stub} "$@"\n')
    exe.chmod(0o755)
    return exe


def backend(python: Path, tmp_path: Path, mode: str = "ok") -> VLLMBackend:
    return VLLMBackend(
        python=python,
        model=str(tmp_path),
        served_model_name="m",
        extra_args=["--mode", mode],
        startup_timeout=30,
    )


async def test_starts_waits_proxies_and_stops(fake_python: Path, tmp_path: Path) -> None:
    b = backend(fake_python, tmp_path)
    await b.start()
    proc = b.process
    assert proc is not None and proc.returncode is None and (await b.health()).ok
    assert b.base_url == f"http://127.0.0.1:{b.port}/v1"
    req = GenerationRequest("r", SamplingParams(max_tokens=5), messages=[{"role": "user", "content": "hi"}])
    stream = await b.generate(req)
    assert "".join([d.text async for c in stream for d in c.deltas]) == "echo: hi"
    await b.stop()
    assert proc.returncode is not None and b.process is None
    assert not (await b.health()).ok
    await b.stop()  # twice is fine


async def test_a_crash_at_start_quotes_the_log(fake_python: Path, tmp_path: Path) -> None:
    b = backend(fake_python, tmp_path, "crash")
    with pytest.raises(BackendUnavailableError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        await b.start()
    assert b.process is None


async def test_a_process_that_ignores_sigterm_is_killed(
    fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("app.serving.backends.vllm.STOP_GRACE_SECONDS", 0.5)
    b = backend(fake_python, tmp_path, "stubborn")
    await b.start()
    proc = b.process
    assert proc is not None
    await b.stop()
    assert proc.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its group is left
