"""int8 products for the steps of many rows beside float32 weights (quantization "auto" with VNNI):
``w8a8_linear`` rounds each row to int8 with its own scale and multiplies exactly in int32. Runs on every CPU
(``torch._int_mm`` is oneDNN's, with VNNI where the CPU has it and without elsewhere)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.engine.kernels.matmul import w8a8_linear
from app.engine.kernels.qblock import qblock_isa
from app.engine.models.layers import Linear
from app.engine.models.quantization import (
    W8A8_OUTLIERS,
    auto_int8_products,
    install_w8a8,
    settle_w8a8,
    w8a8_pending,
)


def _linear(out_f: int, in_f: int, bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_f, out_f, bias=bias)
    layer.weight = nn.Parameter(torch.randn(out_f, in_f) * 0.05, requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.randn(out_f) * 0.1, requires_grad=False)
    return layer


def _calibrated(layer: Linear, sample: torch.Tensor) -> Linear:
    install_w8a8(layer)
    assert w8a8_pending(layer)
    reference = layer.forward(sample)  # before its calibration, the layer runs in float32 and measures
    torch.testing.assert_close(reference, sample @ layer.weight.t() + (0 if layer.bias is None else layer.bias))
    settle_w8a8(layer)
    assert not w8a8_pending(layer)
    return layer


def _int_mm_is_exact() -> bool:
    """oneDNN's s8s8 product sums exactly in int32 with VNNI; its AVX2 kernel saturates 16-bit pair sums."""
    a = torch.randint(-127, 128, (16, 576), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    b = torch.randint(-127, 128, (576, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    return torch.equal(torch._int_mm(a, b), a.int() @ b.int())


def test_auto_uses_int8_products_only_where_they_sum_exactly() -> None:
    """Where the CPU's int8 product is not exact (AVX2 without VNNI: about 10% error on SmolLM2's shapes, and
    slower than float32, scripts/bench_int8_matmul.py), quantization auto never runs it."""
    if not _int_mm_is_exact():
        assert not auto_int8_products(qblock_isa())
    if auto_int8_products(qblock_isa()):
        assert _int_mm_is_exact()


def test_the_product_is_the_int8_rounding_of_both_sides_summed_exactly() -> None:
    if not _int_mm_is_exact():
        pytest.skip("this CPU's int8 product saturates (no VNNI): auto does not use it (the test above)")
    layer = _linear(96, 160, bias=True)
    sample = torch.randn(40, 160)
    sample[:, [3, 77]] *= 50  # two massive channels, as a model's residual stream has
    _calibrated(layer, sample)
    int8 = layer.int8
    assert int8 is not None and int8.outliers is not None
    assert int8.qweight_t.dtype == torch.int8 and int8.qweight_t.shape == (160, 96) and int8.qweight_t.is_contiguous()
    channels, columns = int8.outliers
    assert len(channels) == W8A8_OUTLIERS and {3, 77} <= set(channels.tolist())
    torch.testing.assert_close(columns, layer.weight[:, channels].t())
    x = torch.randn(40, 160)
    x[:, [3, 77]] *= 50
    out = layer.forward(x)
    # the same numbers in float64: the outlier channels in float, the others rounded by their row's max / 127
    # and by max|w| / 127 per output channel
    rest = x.double().index_fill(1, channels, 0.0)
    xs = rest.abs().amax(1, keepdim=True) / 127
    expected = (torch.round(rest / xs) @ int8.qweight_t.double()) * xs * int8.scales.double()
    expected += x.double()[:, channels] @ columns.double() + layer.bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)
    # close to the float32 product, and much closer than rounding the massive channels with the rest
    reference = x @ layer.weight.t() + layer.bias
    error = (out - reference).abs().max()
    assert error < 0.02 * reference.abs().max()
    assert int8.qweight_t[channels].abs().sum() == 0  # their codes are not in the int8 product
    rounded = _linear(96, 160, bias=True)  # the same layer with every channel rounded
    install_w8a8(rounded)
    assert rounded.int8 is not None
    assert (w8a8_linear(x, rounded.int8.qweight_t, rounded.int8.scales, rounded.bias) - reference).abs().max() > 3 * error


def test_a_rows_rounding_does_not_depend_on_the_batch() -> None:
    """Each row is rounded by its own scale and summed exactly in int32: only the float32 product of the few
    outlier channels may round differently by batch size, as any float32 product does."""
    layer = _calibrated(_linear(64, 128, bias=False), torch.randn(8, 128))
    x = torch.randn(33, 128)
    batch = layer.forward(x)
    for i in (0, 17, 32):
        torch.testing.assert_close(layer.forward(x[i : i + 1].clone()), batch[i : i + 1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.forward(x[5:30].clone()), batch[5:30], rtol=1e-6, atol=1e-6)
    assert layer.int8 is not None
    no_outliers = layer.int8.qweight_t, layer.int8.scales
    alone = w8a8_linear(x[3:4].clone(), *no_outliers)
    assert torch.equal(alone, w8a8_linear(x, *no_outliers)[3:4])  # the int8 part alone: bit for bit


def test_zero_rows_and_padding_stay_zero() -> None:
    qweight_t = torch.randint(-127, 128, (32, 16), dtype=torch.int8)
    out = w8a8_linear(torch.zeros(3, 32), qweight_t, torch.ones(16))
    assert torch.equal(out, torch.zeros(3, 16))


def test_only_float32_weights_get_an_int8_copy() -> None:
    model = nn.Sequential(_linear(8, 16, bias=False), _linear(8, 8, bias=False))
    model[1].weight = nn.Parameter(model[1].weight.bfloat16(), requires_grad=False)
    assert install_w8a8(model) == 1
    assert model[0].int8 is not None and model[1].int8 is None


def test_the_fused_rounding_and_scaling_give_the_torch_path_bit_for_bit() -> None:
    """elementwise.c's two passes (round each row, scale the int32 sums back) against the same steps in torch ops,
    which run where the C kernels are not built."""
    from app.engine.kernels import library

    if not library.available():
        pytest.skip("no C kernels here: the torch ops alone run, and the tests above check them")
    layer = _calibrated(_linear(200, 96, bias=True), torch.randn(16, 96) * torch.linspace(0.1, 30, 96))
    int8 = layer.int8
    assert int8 is not None and int8.outliers is not None and int8.keep is not None
    assert int8.keep.sum() == 96 - W8A8_OUTLIERS and torch.equal(int8.keep[int8.outliers[0]], torch.zeros(8))
    for rows in (1, 7, 64):
        x = torch.randn(rows, 96) * torch.linspace(0.1, 30, 96)
        fused = w8a8_linear(x, int8.qweight_t, int8.scales, layer.bias, int8.outliers, int8.keep)
        plain = w8a8_linear(x, int8.qweight_t, int8.scales, layer.bias, int8.outliers)
        assert torch.equal(fused, plain)
