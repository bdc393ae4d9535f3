"""Fused per-token ops of a Llama layer (``elementwise.c``): residual add + RMSNorm, SwiGLU, in-place RoPE.

Each wrapper returns None (or False) when the kernel does not apply: CPU float32, unit stride along the last
dimension, a width that is a multiple of 8. The caller then runs its PyTorch formula.
"""

from __future__ import annotations

import torch

import app.engine.kernels.library as library
from app.engine.kernels.cpu_features import avx512_enabled


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(1) == 1


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``residual += x`` (or ``residual = x`` when None), then ``(rms_norm(residual) * weight, residual)``.

    The residual stream (float32) is updated in place, so pass a tensor this layer owns. ``x`` may be bfloat16
    when there is a residual (widened exactly); the normed rows come in ``out_dtype``, float32 or bfloat16
    (rounded as ``.to`` rounds).
    """
    lib = library.get()
    if lib is None or out_dtype not in (torch.float32, torch.bfloat16):
        return None
    x_bf16 = x.dtype == torch.bfloat16 and residual is not None
    if x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 or not (x_bf16 or x.dtype == torch.float32):
        return None
    if x.shape[1] % 8 or not weight.is_contiguous():
        return None
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.numel() != x.shape[1]:
        return None
    if residual is not None and (not _rows_ok(residual) or residual.shape != x.shape):
        return None
    rows, dim = x.shape
    stream = residual if residual is not None else x
    out = torch.empty(rows, dim, dtype=out_dtype)
    flags = (residual is not None) | x_bf16 << 1 | (out_dtype == torch.bfloat16) << 2
    lib.add_rms_norm(
        x.data_ptr(),
        x.stride(0),
        stream.data_ptr(),
        stream.stride(0),
        flags,
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        dim,
        rows,
        dim,
        torch.get_num_threads(),
        library.use_pool(rows),
    )
    return out, stream


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[rows, 2 * inter]``, float32 or bfloat16 (then the
    result is bfloat16 too: computed in float32 and rounded once, as ``silu_mul(gate_up.float()).bfloat16()``)."""
    lib = library.get()
    bf16 = gate_up.dtype == torch.bfloat16
    if lib is None or gate_up.dim() != 2 or gate_up.device.type != "cpu" or gate_up.stride(1) != 1:
        return None
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.shape[1] % 16:
        return None
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    lib.silu_mul(
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        inter,
        rows,
        inter,
        int(bf16),
        torch.get_num_threads(),
        library.use_pool(rows),
    )
    return out


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x`` ``[T, heads, head_dim]`` in place ("rotate half"); ``cos``/``sin`` ``[T, 1, head_dim // 2]``
    float32. ``x`` float32, or bfloat16 (rotated in float32 from its exact values, the result rounded once).

    ``x`` may be a view into a wider row (the q|k part of a fused projection); heads must be adjacent.
    """
    lib = library.get()
    if (
        lib is None
        or x.dim() != 3
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type != "cpu"
    ):
        return False
    rows, heads, head_dim = x.shape
    half = head_dim // 2
    if head_dim % 16 or x.stride(2) != 1 or x.stride(1) != head_dim:
        return False
    for t in (cos, sin):
        if t.dtype != torch.float32 or t.shape != (rows, 1, half) or t.stride(2) != 1 or t.stride(0) != half:
            return False
    lib.rope_inplace(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        half,
        rows,
        heads,
        head_dim,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
        library.use_pool(rows),
    )
    return True


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Store the new tokens' ``key``/``value`` ``[T, kv_heads, head_dim]`` (float32 or both bfloat16, heads adjacent; views into
    a fused projection are fine) at their ``slot_mapping`` slots of one layer's ``kv_cache`` ``[2, blocks,
    block_size, kv_heads, head_dim]`` (float32, or bfloat16: rounded to nearest even, as ``.to`` rounds).
    False when it does not apply."""
    lib = library.get()
    if lib is None or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return False
    if kv_cache.dtype not in (torch.float32, torch.bfloat16) or slot_mapping.dtype != torch.int64:
        return False
    kvh, hd = kv_cache.shape[3], kv_cache.shape[4]
    if key.dtype not in (torch.float32, torch.bfloat16) or value.dtype != key.dtype:
        return False
    for t in (key, value):
        if t.device.type != "cpu" or t.shape[1:] != (kvh, hd):
            return False
        if t.stride(2) != 1 or t.stride(1) != hd:
            return False
    if (kvh * hd) % 8 or not slot_mapping.is_contiguous() or slot_mapping.shape[0] != key.shape[0]:
        return False
    lib.write_kv(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        key.shape[0],
        kvh * hd,
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        int(kv_cache.dtype == torch.bfloat16),
        int(key.dtype == torch.bfloat16),
        torch.get_num_threads(),
        library.use_pool(key.shape[0]),
    )
    return True


def use_avx512(on: bool) -> None:
    """Run the AVX-512 builds of these kernels (the default where the CPU has it and ``INF_ENGINE_DISABLE_AVX512``
    is not set) or the AVX2 ones; both give the same bits. For tests and comparisons."""
    lib = library.get()
    if lib is not None:
        lib.elementwise_use_avx512(int(on))


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` for float32 ``[rows, cols]`` on CPU (the first index of the largest value, a NaN
    counting as largest): PyTorch's reduction runs at under 1 GB/s here, and a step of 64 greedy rows over a
    49k vocabulary spends milliseconds in it. None when it does not apply."""
    found = _argmax(x, with_ties=False)
    return None if found is None else found[0]


def argmax_ties(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`argmax_rows` and, per row, how many values equal its largest one (1: no tie)."""
    return _argmax(x, with_ties=True)


def _argmax(x: torch.Tensor, *, with_ties: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    lib = library.get()
    if lib is None or not _rows_ok(x) or x.shape[1] == 0:
        return None
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.long)
    ties = torch.ones(rows, dtype=torch.long)
    if rows:
        threads = torch.get_num_threads() if rows * x.shape[1] >= 1 << 16 else 1
        lib.argmax_rows(
            x.data_ptr(),
            x.stride(0),
            rows,
            x.shape[1],
            out.data_ptr(),
            ties.data_ptr() if with_ties else None,
            threads,
            library.use_pool(rows),
        )
    return out, ties


def check_elementwise() -> bool:
    """The three kernels against their PyTorch formulas on random rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    res = torch.randn(5, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    fused = add_rms_norm(x, res.clone(), w, 1e-5)
    h = x + res
    ok = fused is not None and torch.allclose(fused[1], h)
    ok = (
        ok
        and fused is not None
        and torch.allclose(fused[0], torch.nn.functional.rms_norm(h, (64,), w, 1e-5), atol=1e-5)
    )
    gu = torch.randn(3, 32, generator=gen) * 8
    sm = silu_mul(gu)
    ok = (
        ok
        and sm is not None
        and torch.allclose(sm, torch.nn.functional.silu(gu[:, :16]) * gu[:, 16:], atol=1e-5)
    )
    q = torch.randn(4, 3, 32, generator=gen)
    ang = torch.randn(4, 1, 16, generator=gen)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = q[..., :16], q[..., 16:]
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    got = q.clone()
    return ok and rope_inplace(got, cos, sin) and torch.allclose(got, want, atol=1e-5)


def _pick_avx512() -> bool:
    """Run once the library is loaded (a self-check that always passes): the AVX-512 builds where they apply."""
    use_avx512(avx512_enabled())
    return True


library.self_checks.append(_pick_avx512)
library.self_checks.append(check_elementwise)


def quantize_rows_i8(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row of float32 ``x`` ``[rows, dim]`` rounded to int8 by its own scale, ``max|x * keep| / 127`` (``keep``
    ``[dim]``: 1, or 0 for channels multiplied in float32 elsewhere, whose codes are clamped), to nearest even as
    ``torch.round``; returns ``(codes [rows, dim], scales [rows, 1])``, or None where the kernel does not apply."""
    lib = library.get()
    if lib is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
        return None
    rows, dim = x.shape
    if dim % 8 or keep.dtype != torch.float32 or keep.numel() != dim or not keep.is_contiguous():
        return None
    codes = torch.empty(rows, dim, dtype=torch.int8)
    scales = torch.empty(rows, 1, dtype=torch.float32)
    lib.quantize_rows_i8(
        x.data_ptr(), x.stride(0), keep.data_ptr(), codes.data_ptr(), scales.data_ptr(), rows, dim,
        torch.get_num_threads(), library.use_pool(rows),
    )
    return codes, scales


def dequantize_i32(acc: torch.Tensor, scales: torch.Tensor, col_scales: torch.Tensor) -> torch.Tensor | None:
    """``acc * scales * col_scales`` in float32 for int32 sums ``acc`` ``[rows, cols]`` (row ``scales`` ``[rows,
    1]``, ``col_scales`` ``[cols]``), written over ``acc``'s memory; None where the kernel does not apply."""
    lib = library.get()
    if lib is None or acc.dim() != 2 or acc.dtype != torch.int32 or not acc.is_contiguous():
        return None
    rows, cols = acc.shape
    if not (scales.is_contiguous() and col_scales.is_contiguous()) or col_scales.numel() != cols:
        return None
    lib.dequantize_i32(
        acc.data_ptr(), scales.data_ptr(), col_scales.data_ptr(), rows, cols,
        torch.get_num_threads(), library.use_pool(rows),
    )
    return acc.view(torch.float32)
