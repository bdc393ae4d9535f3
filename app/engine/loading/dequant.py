"""Vectorised numpy dequantisation of GGML tensor data to float32.

Block layouts (ggml ``ggml-common.h``), 32 weights per block, little-endian:

* ``Q8_0``: fp16 scale ``d``, 32 × int8 ``q``                          → ``d * q``             (34 bytes)
* ``Q4_0``: fp16 scale ``d``, 16 bytes of nibbles                       → ``d * (q - 8)``       (18 bytes)
* ``Q4_1``: fp16 scale ``d``, fp16 min ``m``, 16 bytes of nibbles        → ``d * q + m``         (20 bytes)

In the 4-bit formats byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high nibble.
Each function works on whole arrays of blocks at once (no Python loop over blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# ggml type ids (GGMLQuantizationType), spelled out so this module needs no gguf import.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
QK = 32  # weights per block in the formats below
_BLOCK_BYTES = {Q8_0: 2 + QK, Q4_0: 2 + QK // 2, Q4_1: 4 + QK // 2}
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}


def _blocks(raw: np.ndarray, qtype: int, numel: int) -> np.ndarray:
    if numel % QK:
        raise ValueError(
            f"{TYPE_NAMES[qtype]} tensor of {numel} weights is not a whole number of {QK}-blocks"
        )
    nbytes = _BLOCK_BYTES[qtype]
    n_blocks = numel // QK
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.size != n_blocks * nbytes:
        raise ValueError(
            f"{TYPE_NAMES[qtype]}: {flat.size} bytes for {numel} weights, expected {n_blocks * nbytes}"
        )
    return flat.reshape(n_blocks, nbytes)


def _f16(cols: np.ndarray) -> np.ndarray:
    """Two byte columns → float32 column ``[n, 1]`` (the copy makes the uint8 slice viewable as fp16)."""
    return np.ascontiguousarray(cols).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` packed bytes → ``[n, 32]`` values 0..15 (low nibbles first, then high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def dequantize_q8_0(raw: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(raw, Q8_0, numel)
    d = _f16(b[:, :2])
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


def dequantize_q4_0(raw: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(raw, Q4_0, numel)
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return (d * q.astype(np.float32)).reshape(-1)


def dequantize_q4_1(raw: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(raw, Q4_1, numel)
    d = _f16(b[:, :2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).astype(np.float32)
    return (d * q + m).reshape(-1)


def q4_groups(
    raw: np.ndarray, qtype: int, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0/Q4_1 matrix ``[rows, cols]`` kept in its own blocks: codes ``[rows, cols]`` (uint8, 0..15) and,
    per block of 32 along a row, ``scale`` and ``zero`` ``[rows, cols / 32]`` (float32) with
    ``weight = (code - 8) * scale + zero``. Q4_0 is ``d * (q - 8)`` (zero 0); Q4_1 is ``d * q + m``, which is
    ``d * (q - 8) + (m + 8d)``. The form of PyTorch's int4 CPU matmul (``_weight_int4pack_mm_for_cpu``)."""
    rows, cols = shape
    if qtype not in (Q4_0, Q4_1):
        raise ValueError(f"{TYPE_NAMES.get(qtype, qtype)} is not a 4-bit block format (Q4_0 or Q4_1)")
    b = _blocks(raw, qtype, rows * cols)
    d = _f16(b[:, :2])
    if qtype == Q4_0:
        codes, zero = _nibbles(b[:, 2:]), np.zeros_like(d)
    else:
        codes, zero = _nibbles(b[:, 4:]), _f16(b[:, 2:4]) + 8.0 * d
    groups = cols // QK
    return codes.reshape(rows, cols), d.reshape(rows, groups), zero.reshape(rows, groups)


def q8_0_groups(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 matrix ``[rows, cols]`` kept in its own blocks: ``q`` ``[rows, cols]`` (int8) and per block of 32
    along a row the scale ``d`` ``[rows, cols / 32]`` (float32): ``weight = d * q``."""
    rows, cols = shape
    b = _blocks(raw, Q8_0, rows * cols)
    d = _f16(b[:, :2])
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8)
    return q.reshape(rows, cols), d.reshape(rows, cols // QK)


def _plain(dtype: type[np.generic]) -> Callable[[np.ndarray, int], np.ndarray]:
    def convert(raw: np.ndarray, numel: int) -> np.ndarray:
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(dtype)
        if flat.size != numel:
            raise ValueError(f"{flat.size} values for a tensor of {numel}")
        return flat.astype(np.float32)

    return convert


def dequantize_bf16(raw: np.ndarray, numel: int) -> np.ndarray:
    # bfloat16 is the top half of a float32: widen by shifting into the high 16 bits.
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(np.uint16)
    if flat.size != numel:
        raise ValueError(f"{flat.size} values for a tensor of {numel}")
    return (flat.astype(np.uint32) << 16).view(np.float32)


DEQUANTIZERS: dict[int, Callable[[np.ndarray, int], np.ndarray]] = {
    F32: _plain(np.float32),
    F16: _plain(np.float16),
    BF16: dequantize_bf16,
    Q8_0: dequantize_q8_0,
    Q4_0: dequantize_q4_0,
    Q4_1: dequantize_q4_1,
}


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of ``shape`` (numpy order, slowest axis first) from a tensor's raw GGML bytes."""
    numel = int(np.prod(shape)) if shape else 1
    fn = DEQUANTIZERS.get(int(qtype))
    if fn is not None:
        return fn(raw, numel).reshape(shape)
    # Other formats (K-quants, Q5_x, ...) are outside what we implement; the gguf package's reference
    # dequantiser handles them, slower but correct.
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
    except ImportError as exc:  # pragma: no cover - gguf is a dependency of GGUF loading
        raise ValueError(f"GGML type {qtype} is not supported and the gguf package is missing") from exc
    try:
        gtype = GGMLQuantizationType(int(qtype))
        out = gguf_dequantize(np.ascontiguousarray(raw).view(np.uint8), gtype)
    except (ValueError, NotImplementedError) as exc:
        raise ValueError(f"GGML tensor type {qtype} cannot be dequantised: {exc}") from exc
    return np.asarray(out, dtype=np.float32).reshape(shape)
