"""Our numpy GGML dequantisers against hand-computed blocks and the gguf package's reference code."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.loading import dequant
from app.engine.loading.gguf import unpermute_qk


def _f16_bytes(x: float) -> bytes:
    return np.array([x], dtype=np.float16).tobytes()


def test_q8_0_block_by_hand() -> None:
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.frombuffer(_f16_bytes(0.5) + q.tobytes(), dtype=np.uint8)
    out = dequant.dequantize(raw, dequant.Q8_0, (32,))
    np.testing.assert_array_equal(out, q.astype(np.float32) * 0.5)


def test_q4_0_block_by_hand() -> None:
    # byte j = low nibble (weight j) | high nibble (weight j + 16)
    lo = np.arange(16, dtype=np.uint8)
    hi = np.arange(15, -1, -1, dtype=np.uint8)
    raw = np.frombuffer(_f16_bytes(2.0) + (lo | (hi << 4)).tobytes(), dtype=np.uint8)
    out = dequant.dequantize(raw, dequant.Q4_0, (32,))
    expected = 2.0 * (np.concatenate([lo, hi]).astype(np.float32) - 8)
    np.testing.assert_array_equal(out, expected)


def test_q4_1_block_by_hand() -> None:
    lo = np.full(16, 3, dtype=np.uint8)
    hi = np.full(16, 15, dtype=np.uint8)
    raw = np.frombuffer(_f16_bytes(0.25) + _f16_bytes(-1.0) + (lo | (hi << 4)).tobytes(), dtype=np.uint8)
    out = dequant.dequantize(raw, dequant.Q4_1, (2, 16))
    expected = np.concatenate([np.full(16, 0.25 * 3 - 1.0), np.full(16, 0.25 * 15 - 1.0)]).reshape(2, 16)
    np.testing.assert_array_equal(out, expected.astype(np.float32))


def test_f16_and_bf16() -> None:
    x = np.array([[1.5, -2.25, 65504.0], [0.0, 1e-3, -7.0]], dtype=np.float32)
    np.testing.assert_array_equal(
        dequant.dequantize(x.astype(np.float16).view(np.uint8), dequant.F16, (2, 3)), x.astype(np.float16)
    )
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation is exact for these values' top bits
    out = dequant.dequantize(bf16.view(np.uint8), dequant.BF16, (2, 3))
    np.testing.assert_array_equal(out, (bf16.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_matches_gguf_reference(qtype: str) -> None:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize as ref_dequantize
    from gguf.quants import quantize

    gtype = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    packed = quantize(data, gtype)
    ours = dequant.dequantize(packed, int(gtype), data.shape)
    ref = ref_dequantize(packed, gtype).reshape(data.shape)
    np.testing.assert_array_equal(ours, ref)
    assert np.abs(ours - data).max() < (0.5 if qtype.startswith("Q4") else 0.05) * np.abs(data).max()


def test_bad_sizes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="whole number"):
        dequant.dequantize(np.zeros(34, np.uint8), dequant.Q8_0, (31,))
    with pytest.raises(ValueError, match="bytes"):
        dequant.dequantize(np.zeros(30, np.uint8), dequant.Q8_0, (32,))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    """llama.cpp's convert script permutes q/k rows as below; unpermute_qk must invert it exactly."""
    rng = np.random.default_rng(1)
    for heads, head_dim, cols in [(4, 8, 5), (2, 16, 3), (1, 4, 2)]:
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
    bias = rng.standard_normal(4 * 8).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(bias.reshape(4, 2, 4).swapaxes(1, 2).reshape(-1), 4), bias)
