"""The kernels' own thread pool: same numbers as the OpenMP path, safe with threads and after fork."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from app.engine import kernels
from app.engine.kernels import library

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler or no AVX2/FMA CPU: the kernels are not built here"
)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def matmul_via(use_pool: int, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """Call the C entry point directly, choosing the pool (1) or OpenMP (0)."""
    lib = library.get()
    assert lib is not None
    rows, k = x.shape
    n = w_t.shape[1]
    out = torch.empty(rows, n)
    scratch = torch.empty(2 * rows * n)
    lib.small_matmul(
        x.data_ptr(), k, w_t.data_ptr(), None, out.data_ptr(), n, rows, k, n, scratch.data_ptr(), 2, use_pool
    )
    return out


def test_pool_and_openmp_give_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1536, generator=gen)
    w_t = torch.randn(1536, 576, generator=gen)
    pooled, omp = matmul_via(1, x, w_t), matmul_via(0, x, w_t)
    assert torch.equal(pooled, omp)
    torch.testing.assert_close(pooled, x @ w_t, rtol=1e-5, atol=1e-4)


def test_many_calls_in_a_row() -> None:
    """Jobs follow each other faster than workers go to sleep; none may see a stale job."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 576, generator=gen)
    weights = [torch.randn(576, n, generator=gen) for n in (960, 576, 3072, 8, 49)]
    for _ in range(200):
        for w_t in weights:
            assert torch.equal(matmul_via(1, x, w_t), matmul_via(0, x, w_t))


def test_concurrent_callers_from_python_threads() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 576, generator=gen)
    w = torch.randn(960, 576, generator=gen).t().contiguous().t()
    expected = F.linear(x, w)
    failures: list[str] = []

    def worker() -> None:
        for _ in range(100):
            got = kernels.small_matmul(x, w)
            if got is None or not torch.allclose(got, expected, rtol=1e-5, atol=1e-4):
                failures.append("mismatch")
                return

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_works_in_a_forked_child() -> None:
    x = torch.randn(2, 576)
    w = torch.randn(960, 576).t().contiguous().t()
    expected = kernels.small_matmul(x, w)  # the parent's pool is running
    assert expected is not None
    pid = os.fork()
    if pid == 0:  # the child inherits no pool threads: the kernel must start its own
        signal.alarm(20)
        got = kernels.small_matmul(x, w)
        os._exit(0 if got is not None and torch.equal(got, expected) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
