"""The C small-row matmul kernel: same numbers as torch, row results independent of the batch, clean fallback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.engine import kernels
from app.engine.kernels import build, library
from app.engine.models.layers import linear

needs_kernel = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler or no AVX2/FMA CPU: the kernel is not built here"
)


def column_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(1, 576, 960), (1, 1536, 576), (3, 100, 7), (8, 576, 8193), (kernels.MAX_ROWS, 130, 1000), (2, 5, 3)],
)
def test_matches_torch(rows: int, k: int, n: int, num_threads: int, threads: None) -> None:
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen)
    w = column_major(torch.randn(n, k, generator=gen))
    b = torch.randn(n, generator=gen)
    for bias in (None, b):
        got = kernels.small_matmul(x, w, bias)
        assert got is not None
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(threads: None) -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(kernels.MAX_ROWS, 576, generator=gen)
    w = column_major(torch.randn(3072, 576, generator=gen))
    batch = kernels.small_matmul(x, w)
    assert batch is not None
    for i in (0, 5, kernels.MAX_ROWS - 1):
        alone = kernels.small_matmul(x[i : i + 1], w)
        assert alone is not None and torch.equal(alone[0], batch[i])


@needs_kernel
def test_strided_rows_are_accepted() -> None:
    x = torch.randn(4, 200)[:, :128]  # row stride 200, unit column stride
    w = column_major(torch.randn(64, 128))
    got = kernels.small_matmul(x, w)
    assert got is not None
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_out_of_scope_inputs_fall_back_to_none() -> None:
    w = column_major(torch.randn(16, 64))
    assert kernels.small_matmul(torch.randn(kernels.MAX_ROWS + 1, 64), w) is None  # a big batch: MKL
    assert kernels.small_matmul(torch.randn(2, 64), torch.randn(16, 64)) is None  # row-major weight
    assert kernels.small_matmul(torch.randn(2, 64, dtype=torch.float64), w.double()) is None
    assert kernels.small_matmul(torch.randn(0, 64), w) is None
    assert kernels.small_matmul(torch.randn(3, 2, 64), w) is None


def test_linear_gives_the_same_result_with_the_kernel_off() -> None:
    x = torch.randn(2, 576)
    w = column_major(torch.randn(960, 576))
    b = torch.randn(960)
    with_kernel = linear(x, w, b)
    kernels.enable(False)
    try:
        assert kernels.small_matmul(x, w, b) is None
        without = linear(x, w, b)
    finally:
        kernels.enable(True)
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-4)


def test_no_compiler_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    assert build.load_kernel(library.LIBRARY, library.SOURCES) is None


@pytest.mark.skipif(not build.cpu_supported(), reason="needs an AVX2/FMA CPU")
def test_a_failing_build_is_a_warning_not_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: cannot compile' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(build, "find_compiler", lambda: str(broken))
    monkeypatch.setattr(build, "cache_dirs", lambda: [tmp_path / "kernels"])
    assert build.load_kernel(library.LIBRARY, library.SOURCES) is None
    assert "cannot compile" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so*"))  # no half-written library left behind


@pytest.mark.skipif(build.find_compiler() is None or not build.cpu_supported(), reason="needs cc and AVX2")
def test_builds_into_the_cache_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(build, "cache_dirs", lambda: [tmp_path])
    assert build.load_kernel(library.LIBRARY, library.SOURCES) is not None
    built = list(tmp_path.glob(f"{library.LIBRARY}-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert build.load_kernel(library.LIBRARY, library.SOURCES) is not None  # cached: not rebuilt
    assert built[0].stat().st_mtime_ns == mtime
