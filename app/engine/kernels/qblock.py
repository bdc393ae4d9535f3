"""GGUF blocks run as they are: Q4_0, Q4_1 and Q8_0 weights times int8-quantized activations
(``qblock_matmul.c``: AVX512-VNNI dot products where the CPU has them, AVX2 elsewhere, the same bits on both).

A :class:`QBlockWeight` holds one matrix in the kernel's layout (4-bit codes two blocks to 32 bytes, float16
scales and mins); :func:`qblock_linear` multiplies by it. Decoding one or a few sequences reads every weight
once per token, so the bytes read are the time: Q4_1 reads 0.63 bytes per weight (float32: 4, bfloat16: 2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import app.engine.kernels.library as library
from app.engine.kernels.cpu_features import cpu_flags, kernel_settings

__all__ = [
    "QBlockWeight",
    "dequantize_qblocks",
    "pack_q4",
    "pack_q8_0",
    "qblock_isa",
    "qblock_linear",
    "qblock_reference",
]

QK = 32  # weights per block
_MAX_K = 1024 * QK  # qblock_matmul.c: MAX_BLOCKS


@dataclass(frozen=True)
class QBlockWeight:
    """One ``[out_features, in_features]`` matrix: ``W[n, 32b + j] = d[n, b] * (code - offset) + m[n, b]``."""

    codes: torch.Tensor  # uint8: 4-bit pairs of blocks ([N, nb * 16]) or 8-bit ([N, nb * 32])
    d: torch.Tensor  # float16 [N, nbp], nbp = blocks rounded up to 8, zero padded
    m: torch.Tensor  # float16 [N, nbp] (zeros when has_min is False)
    bits: int
    offset: int
    has_min: bool
    in_features: int
    out_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and (Q4_1) mins."""
        parts = (self.codes, self.d, self.m) if self.has_min else (self.codes, self.d)
        return sum(t.numel() * t.element_size() for t in parts)


def _pad_blocks(values: torch.Tensor) -> torch.Tensor:
    rows, nb = values.shape
    nbp = -(-nb // 8) * 8
    out = torch.zeros(rows, nbp, dtype=torch.float16)
    out[:, :nb] = values.to(torch.float16)
    return out


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> QBlockWeight:
    """Pack 4-bit ``codes`` ``[N, K]`` (0..15) with per-block ``scale`` ``[N, K / 32]``: Q4_1 (``W = scale *
    code + minimum``) or, with ``minimum`` None, Q4_0 (``W = scale * (code - 8)``). ``K`` a multiple of 64."""
    rows, cols = codes.shape
    if cols % (2 * QK) or cols > _MAX_K:
        raise ValueError(f"4-bit blocks need in_features a multiple of 64 (at most {_MAX_K}), got {cols}")
    blocks = codes.to(torch.uint8).reshape(rows, cols // (2 * QK), 2, QK)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()
    has_min = minimum is not None
    m = _pad_blocks(minimum if minimum is not None else torch.zeros_like(scale))
    return QBlockWeight(packed, _pad_blocks(scale), m, 4, 0 if has_min else 8, has_min, cols, rows)


def pack_q8_0(q: torch.Tensor, scale: torch.Tensor) -> QBlockWeight:
    """Pack Q8_0: int8 ``q`` ``[N, K]`` with per-block ``scale`` ``[N, K / 32]``, ``W = scale * q``."""
    rows, cols = q.shape
    if cols % QK or cols > _MAX_K:
        raise ValueError(f"Q8_0 blocks need in_features a multiple of 32 (at most {_MAX_K}), got {cols}")
    codes = (q.to(torch.int16) + 128).to(torch.uint8).contiguous()
    return QBlockWeight(
        codes, _pad_blocks(scale), _pad_blocks(torch.zeros_like(scale)), 8, 128, False, cols, rows
    )


def dequantize_qblocks(w: QBlockWeight) -> torch.Tensor:
    """The float32 matrix the blocks stand for (tests and reference)."""
    nb = w.in_features // QK
    if w.bits == 4:
        pairs = w.codes.reshape(w.out_features, nb // 2, QK)
        codes = torch.stack((pairs & 15, pairs >> 4), dim=2).reshape(w.out_features, nb, QK)
    else:
        codes = w.codes.reshape(w.out_features, nb, QK)
    values = (codes.float() - w.offset) * w.d[:, :nb, None].float() + w.m[:, :nb, None].float()
    return values.reshape(w.out_features, w.in_features)


def _scratch_floats(rows: int, cols: int) -> int:
    """qblock_matmul.c's qblock_scratch_bytes, in floats: int8 values, scales and sums, lane corrections."""
    blocks = -(-cols // QK)
    padded = -(-blocks // 8) * 8
    return (rows * (blocks * QK + 8 * padded + 32 * blocks) + 64) // 4 + 1


@functools.cache
def qblock_isa() -> str:
    """``vnni`` (AVX512-VNNI dot products) or ``avx2``; ``INF_ENGINE_DISABLE_AVX512=1`` forces ``avx2``."""
    if kernel_settings().disable_avx512:
        return "avx2"
    flags = cpu_flags()
    return "vnni" if {"avx512f", "avx512vl", "avx512_vnni"} <= flags else "avx2"


def qblock_linear(
    x: torch.Tensor, w: QBlockWeight, bias: torch.Tensor | None = None, *, isa: str | None = None
) -> torch.Tensor | None:
    """``x @ W.T + bias`` in float32 for float32 ``x`` ``[M, in_features]`` (CPU), activations quantized to
    int8 per block of 32 on the way in; None when the kernels are not available."""
    lib = library.get()
    if lib is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if x.shape[1] != w.in_features or (bias is not None and bias.dtype != torch.float32):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, w.out_features, dtype=torch.float32)
    if rows == 0:
        return out
    scratch = library.scratch(_scratch_floats(rows, w.in_features))
    chosen = qblock_isa() if isa is None else isa
    failed = lib.qblock_matmul(
        x.data_ptr(),
        x.stride(0),
        rows,
        w.in_features,
        w.codes.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr(),
        w.bits,
        w.offset,
        int(w.has_min),
        w.out_features,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        w.out_features,
        scratch.data_ptr(),
        int(chosen == "vnni"),
        torch.get_num_threads(),
        library.use_pool(rows),
    )
    return None if failed else out


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` as the kernel sees it: rounded per block of 32 to ``scale * q``, ``q`` int8 in
    [-127, 127] and ``scale = max|x| / 127`` (a float32 reference of its first step)."""
    rows, cols = x.shape
    pad = -cols % QK
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).reshape(rows, -1, QK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse)
    return (q * scale).reshape(rows, -1)[:, :cols]


def qblock_reference(x: torch.Tensor, w: QBlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`qblock_linear` computes, in PyTorch (the path where the C kernels are off): the same
    quantized activations times the dequantized weight, summed in another order (so equal to ~1e-6)."""
    flat = x.reshape(-1, x.shape[-1])
    out = quantize_activations(flat) @ dequantize_qblocks(w).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
