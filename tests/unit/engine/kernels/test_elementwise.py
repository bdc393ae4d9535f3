"""Fused residual-add + RMSNorm, SwiGLU and in-place RoPE kernels against their PyTorch formulas."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from app.engine import kernels
from app.engine.kernels.cpu_features import avx512_enabled, bf16_products_supported, cpu_flags
from app.engine.models.layers import Linear, RMSNorm, apply_rope, apply_rope_, bf16_swiglu_mlp, silu_mul
from app.engine.models.quantization import install_q4

needs_kernel = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler or no AVX2/FMA CPU: the kernels are not built here"
)
ROWS = [1, 3, 40]  # 40 rows take the multi-threaded path


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
    kernels.enable(True)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    stream = res.clone()
    fused = kernels.add_rms_norm(x, stream, w, 1e-5)
    assert fused is not None
    out, new_stream = fused
    assert new_stream is stream  # updated in place
    torch.testing.assert_close(stream, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x + res, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    first = kernels.add_rms_norm(x, None, w, 1e-5)  # first layer: the stream is x itself
    assert first is not None and first[1] is x
    torch.testing.assert_close(first[0], F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 6  # wide range: both sigmoid branches, saturation
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 80.0, -100.0])
    got = kernels.silu_mul(gate_up)
    assert got is not None
    want = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_on_a_fused_projection(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 960, generator=gen)  # q (9 heads) | k (3 heads) | v (3 heads), head_dim 64
    before = qkv.clone()
    angles = torch.randn(rows, 1, 32, generator=gen) * 10
    cos, sin = angles.cos(), angles.sin()
    qk = qkv[:, :768].view(rows, 12, 64)
    assert kernels.rope_inplace(qk, cos, sin)
    want = apply_rope(before[:, :768].view(rows, 12, 64), cos, sin)
    torch.testing.assert_close(qk, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 768:], before[:, 768:])  # v untouched


def test_out_of_scope_inputs_are_refused() -> None:
    w = torch.randn(12)
    assert kernels.add_rms_norm(torch.randn(2, 12), None, w, 1e-5) is None  # width not a multiple of 8
    assert kernels.add_rms_norm(torch.randn(2, 16).double(), None, w.double(), 1e-5) is None
    assert kernels.silu_mul(torch.randn(2, 24)) is None
    assert not kernels.rope_inplace(
        torch.randn(2, 3, 64).transpose(0, 1), torch.ones(3, 1, 32), torch.ones(3, 1, 32)
    )


@pytest.mark.parametrize("use_kernels", [True, False])
def test_layer_helpers_agree_with_and_without_kernels(use_kernels: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(64, 1e-6)
    norm.weight = torch.nn.Parameter(torch.randn(64, generator=gen), requires_grad=False)
    x, res = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    gate_up = torch.randn(5, 64, generator=gen)
    qk = torch.randn(5, 4, 32, generator=gen)
    angles = torch.randn(5, 1, 16, generator=gen)
    kernels.enable(use_kernels)
    with torch.inference_mode():
        out, stream = norm.add_forward(x, res.clone())
        rotated = apply_rope_(qk.clone(), angles.cos(), angles.sin())
        swiglu = silu_mul(gate_up)
    torch.testing.assert_close(stream, x + res)
    torch.testing.assert_close(out, F.rms_norm(x + res, (64,), norm.weight, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotated, apply_rope(qk, angles.cos(), angles.sin()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swiglu, F.silu(gate_up[:, :32]) * gate_up[:, 32:], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_in_bfloat16_rounds_the_float32_result_once(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 6).bfloat16()
    gate_up[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    got = kernels.silu_mul(gate_up)
    want = kernels.silu_mul(gate_up.float())
    assert got is not None and want is not None and got.dtype == torch.bfloat16
    assert torch.equal(got[:, 3:], want.bfloat16()[:, 3:])  # bit for bit: one rounding, to nearest even
    assert got[0, 0].isnan()


@needs_kernel
def assert_fused_mlp_is_the_plain_route(x: torch.Tensor, gate_up: Linear, down: Linear) -> None:
    """bf16_swiglu_mlp gives float32 rows, bit for bit those of the unfused products and SwiGLU."""
    with torch.inference_mode():
        fused = bf16_swiglu_mlp(x, gate_up, down)
        plain = down(silu_mul(gate_up(x)))
    assert fused is not None and fused.dtype == torch.float32
    assert torch.equal(fused, plain)


@pytest.mark.skipif(not bf16_products_supported(), reason="no bfloat16 products on this CPU")
def test_bf16_mlp_keeps_its_middle_in_bfloat16_with_the_same_numbers() -> None:
    gen = torch.Generator().manual_seed(11)
    gate_up, down = Linear(64, 256, bias=False), Linear(128, 64, bias=False)
    gate_up.weight = torch.nn.Parameter(torch.randn(256, 64, generator=gen).bfloat16(), requires_grad=False)
    down.weight = torch.nn.Parameter(torch.randn(64, 128, generator=gen).bfloat16(), requires_grad=False)
    x = torch.randn(37, 64, generator=gen)
    assert_fused_mlp_is_the_plain_route(x, gate_up, down)
    assert bf16_swiglu_mlp(x.double(), gate_up, down) is None


@needs_kernel
def test_4bit_mlp_keeps_its_middle_in_bfloat16_with_the_same_numbers() -> None:
    gen = torch.Generator().manual_seed(12)
    gate_up, down = Linear(64, 256, bias=False), Linear(128, 64, bias=False)
    for lin in (gate_up, down):
        out_f, in_f = lin.weight.shape
        lin.weight = torch.nn.Parameter(torch.empty(out_f, in_f), requires_grad=False)
        codes = torch.randint(0, 16, (out_f, in_f), generator=gen)
        scale = torch.rand(out_f, in_f // 32, generator=gen) / 8
        install_q4(lin, codes, scale, torch.randn(out_f, in_f // 32, generator=gen) / 8)
    assert_fused_mlp_is_the_plain_route(torch.randn(37, 64, generator=gen), gate_up, down)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_write_kv_stores_what_index_copy_stores(tokens: int, dtype: torch.dtype) -> None:
    """The new K/V (views into a fused projection) at their slots, rounded as ``.to`` rounds; other slots
    untouched."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15, 64, generator=gen) * 50  # q (9 heads) | k (3) | v (3): strided views
    qkv[0, 9, :3] = torch.tensor([float("nan"), float("inf"), 1e-40])
    key, value = qkv[:, 9:12], qkv[:, 12:]
    cache = torch.randn(2, 40, 8, 3, 64, generator=gen).to(dtype)
    slots = torch.randperm(320, generator=gen)[:tokens]
    want = cache.clone()
    want[0].view(-1, 3, 64).index_copy_(0, slots, key.to(dtype))
    want[1].view(-1, 3, 64).index_copy_(0, slots, value.to(dtype))
    assert kernels.write_kv(cache, key, value, slots)
    # bit for bit, NaN aside (its payload may differ from PyTorch's vectorised rounding)
    torch.testing.assert_close(cache.float(), want.float(), rtol=0, atol=0, equal_nan=True)
    assert cache[0].view(-1, 3, 64)[slots[0], 0, 0].isnan()
    assert not kernels.write_kv(cache, key.double(), value.double(), slots)


def test_argmax_rows_is_torch_argmax_ties_nans_and_infinities_included() -> None:
    from app.engine.kernels.elementwise import argmax_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 49157, generator=gen)  # not a multiple of 8: the tail runs too
    x[1, 100] = x[1, 40000] = 1e9  # a tie: the first index
    x[2, 7] = float("nan")  # a NaN counts as the largest
    x[2, 9000] = float("inf")
    x[3] = float("-inf")  # every value -inf: index 0
    x[4, 49156] = 50.0  # the largest in the tail
    x[5, 3] = x[5, 11] = float("nan")
    got = argmax_rows(x)
    assert got is not None and torch.equal(got, x.argmax(dim=-1))
    strided = torch.randn(4, 300, generator=gen)[:, 7:260]
    got = argmax_rows(strided)
    assert got is not None and torch.equal(got, strided.argmax(dim=-1))
    assert argmax_rows(torch.randn(3, 5).double()) is None  # float32 only


def test_add_rms_norm_takes_bf16_rows_and_gives_bf16_rows_as_the_conversions_would() -> None:
    from app.engine.kernels.elementwise import add_rms_norm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 64, generator=gen).bfloat16()  # a bfloat16 product's output
    residual = torch.randn(70, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    want_stream = residual + x.float()
    want = add_rms_norm(x.float(), residual.clone(), weight, 1e-5)
    got = add_rms_norm(x, residual, weight, 1e-5, torch.bfloat16)
    assert want is not None and got is not None
    assert got[1] is residual and torch.equal(residual, want_stream)  # updated in place, exactly
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0].bfloat16())  # rounded as .to rounds
    # no residual yet (the first layer): the float32 rows themselves, normed into bfloat16
    first = add_rms_norm(residual.clone(), None, weight, 1e-5, torch.bfloat16)
    assert first is not None and torch.equal(first[0], want[0].bfloat16())
    assert add_rms_norm(x, None, weight, 1e-5) is None  # a bfloat16 stream of its own: not taken


@pytest.mark.skipif(
    not {"avx512f", "avx512dq", "avx512bw"} <= cpu_flags(), reason="this CPU has no AVX-512 F/DQ/BW"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_mul_avx512_and_avx2_give_the_same_bits(dtype: torch.dtype) -> None:
    from app.engine.kernels.elementwise import silu_mul, use_avx512

    gen = torch.Generator().manual_seed(2)
    gu = (torch.randn(37, 2 * 96, generator=gen) * 6).to(dtype)
    gu[0, :4] = torch.tensor([0.0, -0.0, -100.0, 100.0])  # zero, signed zero, exp underflow, large
    try:
        use_avx512(False)
        narrow = silu_mul(gu)
        use_avx512(True)
        wide = silu_mul(gu)
    finally:
        use_avx512(avx512_enabled())
    assert narrow is not None and wide is not None and torch.equal(narrow, wide)
    want = torch.nn.functional.silu(gu[:, :96].float()) * gu[:, 96:].float()
    torch.testing.assert_close(
        wide.float(), want.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5
    )


def test_rope_and_write_kv_take_bf16_rows_as_the_float32_path_rounds_them() -> None:
    from app.engine.kernels.elementwise import rope_inplace, write_kv

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, 32, generator=gen).bfloat16()
    ang = torch.randn(5, 1, 16, generator=gen)
    cos, sin = ang.cos(), ang.sin()
    wide, narrow = x.float(), x.clone()
    assert rope_inplace(wide, cos, sin) and rope_inplace(narrow, cos, sin)
    assert torch.equal(narrow, wide.bfloat16())  # rotated in float32, rounded once
    for cache_dtype in (torch.bfloat16, torch.float32):
        a = torch.zeros(2, 4, 2, 3, 16, dtype=cache_dtype)
        b = torch.zeros_like(a)
        key, value = (torch.randn(3, 3, 16, generator=gen).bfloat16() for _ in range(2))
        slots = torch.tensor([5, 0, 7])
        assert write_kv(a, key, value, slots) and write_kv(b, key.float(), value.float(), slots)
        assert torch.equal(a, b)


def test_tied_bf16_logits_are_refined_in_float32_so_argmax_picks_the_larger() -> None:
    from app.engine.models.base import refine_tied_maxima

    hidden = torch.zeros(2, 32)
    hidden[:, 0] = 1.0
    head = torch.zeros(5, 32, dtype=torch.bfloat16)
    # two rows of the head whose products with the hidden row round to the same bfloat16 value (8 bits)
    head[1, 0], head[3, 0] = 10.0, 10.0
    head[3, 1] = 0.01  # row 3 is truly larger, by less than a bfloat16 step of 10
    hidden[:, 1] = 1.0
    logits = (hidden.bfloat16() @ head.t()).float()  # as oneDNN gives it: rounded to bfloat16
    assert logits[0, 1] == logits[0, 3] and logits.argmax(dim=-1).tolist() == [1, 1]
    refine_tied_maxima(logits, hidden, head)
    assert logits.argmax(dim=-1).tolist() == [3, 3]
    assert logits[0, 3] == torch.tensor(10.0 + float(torch.tensor(0.01).bfloat16()))
    untied = torch.tensor([[1.0, 3.0, 2.0]])
    refine_tied_maxima(untied, torch.ones(1, 4), torch.ones(3, 4, dtype=torch.bfloat16))
    assert untied.tolist() == [[1.0, 3.0, 2.0]]  # nothing tied: nothing changes
