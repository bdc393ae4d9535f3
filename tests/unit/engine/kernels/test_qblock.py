"""The qblock kernel: GGUF Q4_0/Q4_1/Q8_0 blocks times int8-quantized activations, on AVX512-VNNI and AVX2.

It must compute exactly what its PyTorch reference says (activations rounded per block of 32, then an exact
integer dot product per block), give the same bits on both instruction sets, and give a row the same numbers
whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import app.engine.kernels as kernels
from app.engine.kernels.cpu_features import cpu_flags
from app.engine.kernels.qblock import (
    QBlockWeight,
    dequantize_qblocks,
    pack_q4,
    pack_q8_0,
    qblock_isa,
    qblock_linear,
    qblock_reference,
    quantize_activations,
)
from app.engine.loading.dequant import Q4_0, Q4_1, Q8_0, dequantize, q4_groups, q8_0_groups

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C kernels not built here")
gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

HAS_VNNI = {"avx512f", "avx512vl", "avx512_vnni"} <= cpu_flags()
ISAS = ["avx2", pytest.param("vnni", marks=pytest.mark.skipif(not HAS_VNNI, reason="no AVX512-VNNI"))]


def weights(kind: str, rows: int, cols: int, seed: int = 0) -> QBlockWeight:
    """A matrix quantized by the gguf package, as a GGUF file would hold it, packed for the kernel."""
    values = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    qtype = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}[kind]
    raw = quantize(values, gguf.GGMLQuantizationType(qtype))
    if kind == "Q8_0":
        q8, d8 = q8_0_groups(raw, (rows, cols))
        blocks = pack_q8_0(torch.from_numpy(q8), torch.from_numpy(d8))
    else:
        codes, scale, zero = (torch.from_numpy(a) for a in q4_groups(raw, qtype, (rows, cols)))
        blocks = pack_q4(codes, scale, None if kind == "Q4_0" else zero - 8 * scale)
    expected = torch.from_numpy(dequantize(raw, qtype, (rows, cols)).reshape(rows, cols))
    assert torch.allclose(dequantize_qblocks(blocks), expected, rtol=0, atol=1e-6)  # the file's values
    return blocks


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 5, 70])
def test_matches_the_reference_of_quantized_activations(kind: str, rows: int, isa: str) -> None:
    w = weights(kind, 200, 192)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(200)
    got = qblock_linear(x, w, bias, isa=isa)
    assert got is not None and got.shape == (rows, 200)
    torch.testing.assert_close(got, qblock_reference(x, w, bias), rtol=1e-5, atol=1e-4)
    # and it is the float product, up to rounding the activations to int8 per block
    assert (got - (x @ dequantize_qblocks(w).t() + bias)).abs().max() < 0.02 * got.abs().max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_both_instruction_sets_give_the_same_bits(kind: str) -> None:
    if not HAS_VNNI:
        pytest.skip("no AVX512-VNNI here: only the AVX2 build runs")
    w = weights(kind, 96, 256, seed=1)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3)) * 5
    narrow, wide = qblock_linear(x, w, isa="avx2"), qblock_linear(x, w, isa="vnni")
    assert narrow is not None and wide is not None and torch.equal(narrow, wide)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_row_gets_the_same_numbers_in_any_batch(kind: str, two_threads: None) -> None:
    w = weights(kind, 300, 128, seed=2)
    x = torch.randn(67, 128, generator=torch.Generator().manual_seed(4))
    batch = qblock_linear(x, w)
    assert batch is not None
    for rows in (slice(0, 1), slice(5, 6), slice(66, 67), slice(3, 9)):
        alone = qblock_linear(x[rows], w)
        assert alone is not None and torch.equal(alone, batch[rows])


def test_q8_0_takes_an_odd_number_of_blocks_and_strided_rows() -> None:
    w = weights("Q8_0", 40, 96)  # 3 blocks
    wide = torch.randn(4, 200)
    x = wide[:, 10:106]  # a row stride of 200
    torch.testing.assert_close(qblock_linear(x, w), qblock_reference(x, w), rtol=1e-5, atol=1e-4)


def test_zero_and_extreme_activations() -> None:
    w = weights("Q4_1", 32, 64)
    x = torch.zeros(2, 64)
    x[1, 5] = 1e30  # one huge value: its block scales to it, the rest of the block rounds to 0
    got = qblock_linear(x, w)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, qblock_reference(x, w), rtol=1e-4, atol=1e-4)
    assert torch.equal(quantize_activations(torch.zeros(1, 64)), torch.zeros(1, 64))


def test_shapes_it_cannot_pack_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_q4(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 3), None)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q8_0(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1))


def test_without_the_kernels_a_linear_runs_the_reference() -> None:
    from app.engine.models.layers import Linear
    from app.engine.models.quantization import install_qblocks

    w = weights("Q4_1", 64, 128)
    lin = Linear(128, 64, bias=False)
    lin.weight = torch.nn.Parameter(torch.empty(64, 128), requires_grad=False)
    install_qblocks(lin, w)
    x = torch.randn(2, 128)
    by_kernel = lin(x)
    kernels.enable(False)
    try:
        assert qblock_linear(x, w) is None
        by_torch = lin(x)  # the same arithmetic in PyTorch
    finally:
        kernels.enable(True)
    torch.testing.assert_close(by_torch, by_kernel, rtol=1e-5, atol=1e-4)
    assert qblock_isa() in ("avx2", "vnni")


def test_the_scratch_python_reserves_covers_the_kernels_needs() -> None:
    from app.engine.kernels import library
    from app.engine.kernels.qblock import _scratch_floats

    lib = library.get()
    assert lib is not None
    for rows, cols in ((1, 32), (3, 576), (512, 1536), (7, 96)):
        assert _scratch_floats(rows, cols) * 4 >= lib.qblock_scratch_bytes(rows, cols)
