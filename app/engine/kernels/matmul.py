"""``x @ weight.T (+ bias)`` for a few rows: the products of decoding, by the C kernel ``small_matmul.c``."""

from __future__ import annotations

import functools
import threading
from typing import Any, cast

import torch

import app.engine.kernels.library as library
from app.engine.kernels.cpu_features import (
    avx512_enabled,
    bf16_products_supported,
    cpu_flags,
    onednn_linear_op,
)
from app.engine.kernels.elementwise import dequantize_i32, quantize_rows_i8

# Up to this many rows the kernel beats MKL (even at 32 rows) and oneDNN (only at 1-2 rows: see onednn_linear).
MAX_ROWS = 24


def small_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` by the C kernel, or None when it does not apply (then use ``F.linear``).

    Applies to CPU float32 with ``x`` ``[rows <= MAX_ROWS, in]`` (unit column stride), ``weight`` ``[out, in]``
    stored column-major (``weight.t()`` contiguous) and ``bias`` ``[out]`` contiguous or None.
    """
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        return None
    lib = library.get()
    if lib is None:
        return None
    w_t = weight.t()
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or not w_t.is_contiguous()
        or x.shape[1] != w_t.shape[0]
        or x.requires_grad
    ):
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = w_t.shape[1]
    out = torch.empty(rows, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    scratch = library.scratch((threads - 1) * rows * n)
    lib.small_matmul(
        x.data_ptr(),
        x.stride(0),
        w_t.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        k,
        n,
        scratch.data_ptr(),
        threads,
        library.use_pool(rows),
    )
    return out


_ONEDNN_LINEAR = onednn_linear_op()
_onednn_enabled = True


@functools.cache
def onednn_bf16_available() -> bool:
    """oneDNN's bfloat16 product on a packed weight runs here: it needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT,
    so an AVX2-only CPU answers no (then a bfloat16 weight goes through ``F.linear``)."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if _ONEDNN_LINEAR is None or reorder is None:
        return False
    try:
        x, w = torch.ones(3, 8, dtype=torch.bfloat16), torch.ones(5, 8, dtype=torch.bfloat16)
        with torch.inference_mode(False), torch.no_grad():
            out = _ONEDNN_LINEAR(x, reorder(w, 3), None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.equal(out.float(), torch.full((3, 5), 8.0)))


def onednn_available() -> bool:
    """oneDNN's linear runs in this build of torch on this CPU."""
    return _ONEDNN_LINEAR is not None


def enable_onednn(on: bool = True) -> None:
    """Use oneDNN for the larger CPU products (the default) or PyTorch's MKL ``F.linear``."""
    global _onednn_enabled
    _onednn_enabled = on


# Products of at least this many rows go to oneDNN: from 3 rows on its blocked GEMM beats the C kernel
# (measured on 2 AVX-512 cores: 1.3x at 4 rows, 2x at 8-24 rows), which stays the faster one for 1-2 rows.
ONEDNN_MIN_ROWS = 3
# oneDNN picks its packed layout for a typical row count; the packed weight serves any row count.
_PACK_ROWS_HINT = 64
_pack_lock = threading.Lock()


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` by oneDNN's matmul on a weight packed once, or None when it does not apply
    (then use ``F.linear``).

    For the batched products of prefill and of many decoding sequences (float32 on CPU), oneDNN with a
    pre-packed weight runs 1.2-1.4x faster than MKL's ``sgemm`` behind ``F.linear`` on a small model's layer
    shapes and up to 2.5x on its 49k-wide LM head at 16-128 rows (vLLM's CPU backend does the same). The packed
    copy is made on first use and kept on the weight; changing the weight in place (its version) repacks it.
    """
    op = _ONEDNN_LINEAR
    if (
        op is None
        or not _onednn_enabled
        or x.dim() != 2
        or x.shape[0] < ONEDNN_MIN_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.requires_grad
        or weight.requires_grad
        or x.shape[1] != weight.shape[1]
    ):
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.requires_grad):
        return None
    packed = _packed(weight)
    if packed is None:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    return cast(torch.Tensor, op(x, packed, bias, "none", [], ""))


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, keep_bf16: bool = False
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for float32 ``x`` and a bfloat16 ``weight`` (CPU): ``x`` is rounded to bfloat16,
    multiplied by oneDNN on the packed weight (AVX512-BF16 dot products, float32 accumulation), and the result
    comes back as float32 (``bias``, float32, added then). None when oneDNN cannot run it. ``x`` may already be
    bfloat16; ``keep_bf16`` (no bias) returns the product as oneDNN gives it, in bfloat16.

    Used for every row count: at 1-16 rows the product streams half the bytes of float32 and runs 2-2.5x
    faster than the float32 C kernel on SmolLM2's shapes, at 64 rows and more the bfloat16 FLOPs win
    (``scripts/engine_roofline.py --dtype bfloat16``). With AVX512-BF16 it is our kernels: up to
    ``BF16_MAX_ROWS`` rows :func:`bf16_small_matmul` on the row-major weight, from there on :func:`bf16_gemm`
    on a packed copy; oneDNN where they do not apply."""
    op = _ONEDNN_LINEAR
    if (
        op is None
        or not onednn_bf16_available()
        or x.dim() != 2
        or x.dtype not in (torch.float32, torch.bfloat16)
        or weight.dtype != torch.bfloat16
        or (keep_bf16 and bias is not None)
        or weight.dim() != 2
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.shape[1] != weight.shape[1]
        or x.shape[0] == 0
    ):
        return None
    x = x.to(torch.bfloat16)
    product = bf16_small_matmul(x, weight)
    if product is None:
        product = bf16_gemm(x, weight)
    if product is None:
        packed = _packed(weight)
        if packed is None:
            return None
        product = op(x, packed, None, "none", [], "")
    if keep_bf16:
        return cast(torch.Tensor, product)
    out = product.float()
    return out if bias is None else out.add_(bias)


# Up to this many rows a bfloat16 product runs in bf16_matmul.c (see bf16_small_matmul), from there on in
# bf16_gemm.c. 0: bf16_gemm.c for every row count. On the AVX512-BF16 EPYC (Zen 5) of session 14 the packed
# kernel was about as fast or faster from 1 row on (scripts/bench_bf16_matmul.py: 0.95-1.15x at 1-4 rows, 1.1-3.5x at
# 8-16), and one kernel for every batch size gives a row the same bits alone and in any batch.
BF16_MAX_ROWS = 0


@functools.cache
def bf16_matmul_supported() -> bool:
    """Our few-row bfloat16 kernel runs here: the CPU has AVX512-BF16 (and AVX-512 F/BW/VL), the AVX-512
    builds are allowed (``INF_ENGINE_DISABLE_AVX512``) and so are bfloat16 products (``INF_ENGINE_DISABLE_BF16``)."""
    return avx512_enabled() and bf16_products_supported() and {"avx512_bf16", "avx512vl"} <= cpu_flags()


def bf16_small_matmul(x: torch.Tensor, weight: torch.Tensor, *, out_f32: bool = False) -> torch.Tensor | None:
    """``x @ weight.T`` for at most ``BF16_MAX_ROWS`` bfloat16 rows and a row-major bfloat16 ``weight`` ``[out,
    in]`` by the C kernel (AVX512-BF16, float32 sums), in bfloat16 (rounded to nearest even, as oneDNN gives it)
    or float32; None when it does not apply. It streams the weight as stored: 1.25-1.66x faster than oneDNN's
    packed product at 1-2 rows on SmolLM2's shapes, about level at 4, on session 13's AVX512-BF16 EPYC
    (``scripts/bench_bf16_matmul.py``; bf16_gemm took over on session 14's host, see BF16_MAX_ROWS), and
    every row comes out the same bits whatever the number of rows."""
    if x.dim() != 2 or not 0 < x.shape[0] <= BF16_MAX_ROWS or x.dtype != torch.bfloat16:
        return None
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        return None
    lib = library.get()
    if lib is None or not bf16_matmul_supported():
        return None
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    lib.bf16_matmul(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        k,
        out.data_ptr(),
        n,
        rows,
        k,
        n,
        int(out_f32),
        torch.get_num_threads(),
        library.use_pool(rows),
    )
    return out


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (qweight * scales[:, None]).T + bias`` in ``x``'s dtype for an int8 ``qweight`` ``[out, in]`` with
    per-row bfloat16 ``scales`` (see app.engine.models.quantization); ``x`` is rounded to bfloat16 first."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    out = torch._weight_int8pack_mm(flat, qweight, scales).to(x.dtype)
    if bias is not None:
        out = out.add_(bias.to(x.dtype))
    return out.view(*shape[:-1], qweight.shape[0])


def w8a8_linear(
    x: torch.Tensor,
    qweight_t: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    outliers: tuple[torch.Tensor, torch.Tensor] | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 rows ``x`` ``[rows, in]`` and ``W = qweight_t.T * scales[:, None]`` (int8
    ``qweight_t`` ``[in, out]``, float32 per-output-channel ``scales``): each row of ``x`` is rounded to int8 with
    its own scale (``max|x| / 127``), the product is ``torch._int_mm``'s exact int32 sums (oneDNN's s8s8 kernel,
    VNNI dot products where the CPU has them), scaled back to float32. ``outliers`` ``(channels [k], weight
    [k, out])``: input channels whose values dwarf the others (a model's massive activations) are left out of the
    rounding and multiplied in float32 instead, as LLM.int8() does (their rows of ``qweight_t`` must be zero). A row's rounding and int32 sums depend on that
    row alone; only the float32 product of the outlier channels may round differently by batch size. ``keep``
    ``[in]`` (1, 0 on the outlier channels): the same rounding in one C pass (elementwise.c), and the scaling back
    in another."""
    out = _w8a8_fused(x, qweight_t, scales, keep)
    if out is None:
        magnitude = x.abs()
        if outliers is not None:  # their rows of qweight_t are zero, so their clamped codes add nothing
            magnitude.index_fill_(1, outliers[0], 0.0)
        amax = magnitude.amax(dim=1, keepdim=True).clamp_min_(1e-30)
        xq = torch.mul(x, 127.0 / amax).round_().clamp_(-127.0, 127.0).to(torch.int8)
        out = torch._int_mm(xq, qweight_t).float().mul_(amax * (1.0 / 127.0)).mul_(scales)
    if outliers is not None:
        out.addmm_(x.index_select(1, outliers[0]), outliers[1])
    return out if bias is None else out.add_(bias)


def _w8a8_fused(
    x: torch.Tensor, qweight_t: torch.Tensor, scales: torch.Tensor, keep: torch.Tensor | None
) -> torch.Tensor | None:
    if keep is None:
        return None
    rounded = quantize_rows_i8(x, keep)
    if rounded is None:
        return None
    return dequantize_i32(torch._int_mm(rounded[0], qweight_t), rounded[1], scales)


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype for a 4-bit ``W`` packed by ``torch._convert_weight_to_int4pack_for_cpu``
    (``[out, in / 2]``) with ``scale_zeros`` ``[in / group_size, out, 2]`` in bfloat16: ``W = (code - 8) * scale +
    zero`` per group. PyTorch's CPU kernel is fast only for bfloat16 activations, so ``x`` is rounded to bfloat16;
    it accumulates in float32. The result is in ``out_dtype`` (default: ``x``'s)."""
    shape = x.shape
    dtype = x.dtype if out_dtype is None else out_dtype
    flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    out = torch._weight_int4pack_mm_for_cpu(flat, packed, group_size, scale_zeros).to(dtype)
    if bias is not None:
        out = out.add_(bias.to(dtype))
    return out.view(*shape[:-1], packed.shape[0])


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, *, out_f32: bool = False) -> torch.Tensor | None:
    """``x @ weight.T`` for more than ``BF16_MAX_ROWS`` bfloat16 rows by the C kernel ``bf16_gemm.c``
    (AVX512-BF16, float32 sums over the dims in order), on a copy of ``weight`` packed on first use and kept on
    it (repacked if the weight changes in place); in bfloat16 (rounded to nearest even) or float32. None when it
    does not apply (no AVX512-BF16, an odd number of dims, a strided row).

    A row's numbers do not depend on how many rows come with it (each output is one float32 sum in a fixed
    order). They are oneDNN's but for the last bit of about 1 output in 20,000 (its order of sums), and the
    kernel runs 1.1-1.4x faster than oneDNN's packed product on SmolLM2's layer shapes at 8-512 rows with the
    weights coming from memory, as a model's do (``scripts/bench_bf16_matmul.py --rows 8,64,128``)."""
    lib = _packed_kernels_for(x, weight)
    if lib is None:
        return None
    packed = gemm_packed(weight, lib)
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    threads = torch.get_num_threads()
    lib.bf16_gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), k, n, rows, out.data_ptr(), n, int(out_f32),
                  threads, library.use_pool(rows))
    return out


def bf16_swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(x @ gate.T) * (x @ up.T)`` in bfloat16 for a fused bfloat16 ``gate_up`` weight ``[2 * inter, in]``
    (gate rows first): the bits of :func:`bf16_gemm` (bfloat16 out) followed by ``kernels.silu_mul``, in one
    pass of ``bf16_gemm.c`` that never writes the ``[rows, 2 * inter]`` product out (the widest tensor of a
    layer, written and read back once per step). None where :func:`bf16_gemm` does not apply or ``inter`` is
    not a multiple of 32."""
    lib = _packed_kernels_for(x, gate_up)
    if lib is None or gate_up.shape[0] % 64:
        return None
    packed = gemm_packed(gate_up, lib, swiglu=True)
    rows, k = x.shape
    inter = gate_up.shape[0] // 2
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    lib.bf16_gemm_swiglu(x.data_ptr(), x.stride(0), packed.data_ptr(), k, inter, rows, out.data_ptr(), inter,
                         torch.get_num_threads(), library.use_pool(rows))
    return out


def _packed_kernels_for(x: torch.Tensor, weight: torch.Tensor) -> Any | None:
    """The kernel library when ``bf16_gemm.c`` takes ``x @ weight.T`` (CPU bfloat16 rows past ``BF16_MAX_ROWS``
    with unit column stride, a 2-D bfloat16 weight with an even number of columns, AVX512-BF16), else None."""
    if x.dim() != 2 or x.shape[0] <= BF16_MAX_ROWS or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        return None
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2 or x.shape[1] != weight.shape[1]:
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or not bf16_matmul_supported():
        return None
    return library.get()


def gemm_packed(weight: torch.Tensor, lib: Any, *, swiglu: bool = False) -> torch.Tensor:
    """``weight`` (bfloat16 ``[out, in]``, ``in`` even) packed for ``bf16_gemm.c``, made once and kept on the
    weight (as oneDNN's copy is): :func:`bf16_gemm` and the C decode layer share it. ``swiglu``: a fused
    ``[gate | up]`` weight packed for :func:`bf16_swiglu` instead (``out`` a multiple of 64)."""
    name = "_inf_bf16_swiglu_packed" if swiglu else "_inf_bf16_gemm_packed"
    cached = getattr(weight, name, None)
    if cached is not None and cached[0] == weight._version:
        return cast(torch.Tensor, cached[1])
    with _pack_lock:
        cached = getattr(weight, name, None)
        if cached is not None and cached[0] == weight._version:
            return cast(torch.Tensor, cached[1])
        n, k = weight.shape
        packed = torch.empty(lib.bf16_gemm_packed_size(n, k), dtype=torch.bfloat16)
        source = weight.detach()
        if source.stride(1) != 1:
            source = source.contiguous()
        if swiglu:
            lib.bf16_gemm_pack_swiglu(source.data_ptr(), source.stride(0), n // 2, k, packed.data_ptr())
        else:
            lib.bf16_gemm_pack(source.data_ptr(), source.stride(0), n, k, packed.data_ptr())
        setattr(weight, name, (weight._version, packed))
        return packed


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    cached = getattr(weight, "_inf_onednn_packed", None)
    if cached is not None and cached[0] == weight._version:
        return cast(torch.Tensor, cached[1])
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None:
        return None
    with _pack_lock:
        cached = getattr(weight, "_inf_onednn_packed", None)
        if cached is not None and cached[0] == weight._version:
            return cast(torch.Tensor, cached[1])
        with torch.inference_mode(False), torch.no_grad():
            packed = reorder(weight.detach().contiguous(), _PACK_ROWS_HINT)
        weight._inf_onednn_packed = (weight._version, packed)  # type: ignore[attr-defined]
        return cast(torch.Tensor, packed)


def check_small_matmul() -> bool:
    """The kernel against ``torch.addmm`` on a few shapes (tails, several rows, one thread's worth of K)."""
    gen = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 200, 37), (3, 130, 1000), (MAX_ROWS, 64, 8)):
        x = torch.randn(rows, k, generator=gen)
        w = torch.randn(k, n, generator=gen).t()  # column-major [n, k]
        b = torch.randn(n, generator=gen)
        got = small_matmul(x, w, b)
        if got is None or not torch.allclose(got, torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4):
            return False
    return True


library.self_checks.append(check_small_matmul)
