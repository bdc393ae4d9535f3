"""Our few-row bfloat16 product (bf16_matmul.c, AVX512-BF16): float32 sums of the bfloat16 inputs, rounded as
torch rounds, the same bits for a row whatever the row count, masked tails, and where it does not apply.

bf16_linear gives it the rows up to ``matmul.BF16_MAX_ROWS``, which is 0 by default (the packed kernel,
bf16_gemm.c, takes every row count): these tests set the limit to ``FEW`` rows."""

from __future__ import annotations

import pytest
import torch

from app.engine.kernels import library, matmul

needs_bf16 = pytest.mark.skipif(
    not (library.available() and matmul.bf16_matmul_supported()),
    reason="needs the C kernels and a CPU with AVX512-BF16",
)


FEW = 4


@pytest.fixture(autouse=True)
def few_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "BF16_MAX_ROWS", FEW)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact products of the bfloat16 values, summed in float64."""
    return (x.double() @ w.double().t()).float()


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(37, 70), (64, 576), (960, 576), (8, 1536), (3, 33)])
@pytest.mark.parametrize("rows", [1, 2, 3, FEW])
def test_float32_sums_of_the_bfloat16_inputs(n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    exact = reference(x, w)
    wide = matmul.bf16_small_matmul(x, w, out_f32=True)
    assert wide is not None and wide.dtype == torch.float32
    torch.testing.assert_close(wide, exact, rtol=1e-5, atol=1e-4 * k**0.5)
    rounded = matmul.bf16_small_matmul(x, w)
    assert rounded is not None and rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, wide.to(torch.bfloat16))  # round to nearest even, as torch does


@needs_bf16
def test_a_row_gives_the_same_bits_alone_and_with_others() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3072 + 5, 576, generator=gen).to(torch.bfloat16)  # every group size, and a tail
    x = torch.randn(FEW, 576, generator=gen).to(torch.bfloat16)
    batch = matmul.bf16_small_matmul(x, w, out_f32=True)
    assert batch is not None
    for i in range(x.shape[0]):
        alone = matmul.bf16_small_matmul(x[i : i + 1], w, out_f32=True)
        assert alone is not None and torch.equal(alone[0], batch[i])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = matmul.bf16_small_matmul(x, w, out_f32=True)
    finally:
        torch.set_num_threads(threads)
    assert single is not None and torch.equal(single, batch)


@needs_bf16
def test_rows_with_a_stride_nan_and_infinity() -> None:
    w = torch.ones(16, 64, dtype=torch.bfloat16)
    wide = torch.zeros(3, 128, dtype=torch.bfloat16)
    wide[:, :64] = 1.0
    wide[1, 0] = float("nan")
    wide[2, 0] = float("inf")
    got = matmul.bf16_small_matmul(wide[:, :64], w)
    assert got is not None
    assert torch.equal(got[0], torch.full((16,), 64.0, dtype=torch.bfloat16))
    assert got[1].isnan().all() and got[2].isinf().all()


@needs_bf16
def test_bf16_linear_uses_it_for_few_rows_and_the_packed_gemm_beyond() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen)
    few = torch.randn(2, 64, generator=gen)
    got = matmul.bf16_linear(few, w, b)
    ours = matmul.bf16_small_matmul(few.to(torch.bfloat16), w)
    assert got is not None and ours is not None
    assert torch.equal(got, ours.float() + b)
    many = torch.randn(FEW + 1, 64, generator=gen)
    assert matmul.bf16_small_matmul(many.to(torch.bfloat16), w) is None
    batched = matmul.bf16_linear(many, w, keep_bf16=True)
    packed = matmul.bf16_gemm(many.to(torch.bfloat16), w)
    assert batched is not None and packed is not None
    assert torch.equal(batched, packed)
    torch.testing.assert_close(batched.float(), reference(many.to(torch.bfloat16), w), rtol=1e-2, atol=5e-2)


def test_out_of_scope_inputs_give_none() -> None:
    w = torch.randn(16, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert matmul.bf16_small_matmul(x.float(), w) is None  # float32 rows: bf16_linear rounds them first
    assert matmul.bf16_small_matmul(x, w.float()) is None
    assert matmul.bf16_small_matmul(x, w.t().contiguous().t()) is None  # column-major: oneDNN's
    assert matmul.bf16_small_matmul(x[:, :32], w) is None  # inner sizes differ
    assert matmul.bf16_small_matmul(torch.randn(2, 4, 64).to(torch.bfloat16), w) is None


def test_no_avx512_bf16_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "bf16_matmul_supported", lambda: False)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert matmul.bf16_small_matmul(x, torch.randn(8, 64).to(torch.bfloat16)) is None
