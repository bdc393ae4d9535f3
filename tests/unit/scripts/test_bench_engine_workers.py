"""scripts/bench_engine.py's worker dispatch: a framework worker (``--worker native-jax`` / ``native-tinygrad``)
runs our engine on that runner itself; it must not start another benchmark of its own (a bug that once made each
framework column spawn two native-engine workers)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from scripts import bench_engine


@pytest.mark.parametrize("worker", ["native", "native-ngram", "native-jax", "native-tinygrad"])
def test_every_engine_worker_runs_the_engine_in_its_own_process(worker: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(bench_engine, "worker_native", lambda args, names: ran.append((args.worker, names)))
    monkeypatch.setattr(bench_engine, "start_engines", lambda *a: pytest.fail("a worker started engines"))
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--worker", worker, "--workloads", "a,c"])
    assert bench_engine.main() == 0
    assert ran == [(worker, ["a", "c"])]


def test_every_framework_worker_is_a_worker_engine() -> None:
    assert set(bench_engine.FRAMEWORK_WORKERS) <= set(bench_engine.WORKER_ENGINES)


def test_the_benchmark_module_imports_without_torch() -> None:
    """CI runs the unit tests on Python 3.12 without the engine extra: importing the driver must not need torch
    (only its workers do)."""
    import subprocess

    check = "import sys; from scripts import bench_engine; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
