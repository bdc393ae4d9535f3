"""Our packed bfloat16 product for batches (bf16_gemm.c, AVX512-BF16): float32 sums of the bfloat16 inputs, rounded
as torch rounds; a row's bits do not depend on the batch it comes in or the thread count; panel and row tails;
the packed copy follows the weight; within a last-bit difference of oneDNN's product, which it replaces."""

from __future__ import annotations

import pytest
import torch

from app.engine import kernels
from app.engine.kernels import library, matmul

needs_bf16 = pytest.mark.skipif(
    not (library.available() and matmul.bf16_matmul_supported()),
    reason="needs the C kernels and a CPU with AVX512-BF16",
)


def inputs(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    return x, w


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(17, 16), (80, 64), (304, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 100])
def test_float32_sums_of_the_bfloat16_inputs(n: int, k: int, rows: int) -> None:
    x, w = inputs(rows, n, k, seed=rows * n + k)
    exact = (x.double() @ w.double().t()).float()
    wide = matmul.bf16_gemm(x, w, out_f32=True)
    assert wide is not None and wide.dtype == torch.float32 and wide.shape == (rows, n)
    torch.testing.assert_close(wide, exact, rtol=1e-5, atol=1e-5 * k**0.5)
    rounded = matmul.bf16_gemm(x, w)
    assert rounded is not None and rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, wide.to(torch.bfloat16))  # round to nearest even, as torch does


@needs_bf16
def test_a_row_gives_the_same_bits_in_any_batch_and_on_any_thread_count(two_threads: None) -> None:
    x, w = inputs(70, 200, 192, seed=5)
    whole = matmul.bf16_gemm(x, w)
    assert whole is not None
    for start, size in ((0, 1), (7, 2), (0, 5), (3, 6), (20, 13), (64, 6), (1, 69)):
        part = matmul.bf16_gemm(x[start : start + size].contiguous(), w)
        assert part is not None and torch.equal(part, whole[start : start + size])
    torch.set_num_threads(1)  # the fixture restores the thread count
    single = matmul.bf16_gemm(x, w)
    assert single is not None and torch.equal(single, whole)


@needs_bf16
def test_rows_with_a_stride() -> None:
    x, w = inputs(9, 64, 64, seed=9)
    wide = torch.zeros(9, 128, dtype=torch.bfloat16)
    wide[:, 32:96] = x
    got, plain = matmul.bf16_gemm(wide[:, 32:96], w), matmul.bf16_gemm(x, w)
    assert got is not None and plain is not None and torch.equal(got, plain)


@needs_bf16
def test_the_packed_copy_follows_the_weight() -> None:
    x, w = inputs(8, 64, 32, seed=11)
    before = matmul.bf16_gemm(x, w)
    w.mul_(2)  # in place: a new version of the weight
    after = matmul.bf16_gemm(x, w)
    assert before is not None and after is not None
    assert torch.equal(after, (before.float() * 2).to(torch.bfloat16))


@needs_bf16
@pytest.mark.skipif(not matmul.onednn_bf16_available(), reason="oneDNN's bfloat16 product does not run here")
def test_within_a_last_bit_of_onednn_on_a_model_shape() -> None:
    x, w = inputs(64, 3072, 576, seed=13)
    ours = matmul.bf16_gemm(x, w)
    packed = matmul._packed(w)
    assert ours is not None and packed is not None
    onednn = matmul._ONEDNN_LINEAR(x, packed, None, "none", [], "")
    differ = ours != onednn
    assert differ.float().mean().item() < 1e-3  # their order of sums differs, rarely the rounded result
    # one bfloat16 ulp of the result, plus what two float32 sums in other orders may differ by: an output that
    # nearly cancels out (1e-6 from terms of size 15) is off by more than its own ulp, as on an AMX CPU, where
    # oneDNN's tiles add in yet another order
    magnitude = x.float().abs() @ w.float().abs().T
    bound = onednn.float().abs() * 2.0**-7 + magnitude * 2.0**-20
    assert ((ours.float() - onednn.float()).abs() <= bound).all()


@needs_bf16
@pytest.mark.parametrize(("inter", "k"), [(32, 64), (96, 576), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 5, 13, 64])
def test_fused_swiglu_gives_the_bits_of_the_product_then_silu_mul(inter: int, k: int, rows: int) -> None:
    x, w = inputs(rows, 2 * inter, k, seed=rows + inter)
    fused = matmul.bf16_swiglu(x, w)
    product = matmul.bf16_gemm(x, w)
    assert fused is not None and product is not None
    unfused = kernels.silu_mul(product)
    assert unfused is not None and torch.equal(fused, unfused)
    w.mul_(-1)  # the fused copy follows the weight too
    again = matmul.bf16_swiglu(x, w)
    flipped = kernels.silu_mul(matmul.bf16_gemm(x, w))  # type: ignore[arg-type]
    assert again is not None and flipped is not None and torch.equal(again, flipped)


def test_fused_swiglu_needs_a_width_of_whole_panels() -> None:
    x, w = inputs(8, 2 * 40, 64, seed=3)  # inter 40: not a multiple of 32
    assert matmul.bf16_swiglu(x, w) is None


def test_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = inputs(8, 16, 64, seed=1)
    monkeypatch.setattr(matmul, "BF16_MAX_ROWS", 4)
    assert matmul.bf16_gemm(x[:4], w) is None  # rows the few-row kernel takes, where it is given some
    monkeypatch.setattr(matmul, "BF16_MAX_ROWS", 0)
    assert matmul.bf16_gemm(x.float(), w) is None
    assert matmul.bf16_gemm(x, w.float()) is None
    assert matmul.bf16_gemm(x[:, :63], w[:, :63]) is None  # an odd number of dims
    assert matmul.bf16_gemm(x[:, :32], w) is None  # inner sizes differ
    assert matmul.bf16_gemm(x.t().contiguous().t(), w) is None  # column-major rows


def test_no_avx512_bf16_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "bf16_matmul_supported", lambda: False)
    x, w = inputs(8, 16, 64, seed=2)
    assert matmul.bf16_gemm(x, w) is None
