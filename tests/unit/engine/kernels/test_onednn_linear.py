"""oneDNN with a packed weight for the larger CPU products: same numbers as torch, one pack for every row count,
a repack when the weight changes in place, and a clean fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.engine.kernels import matmul
from app.engine.models.layers import linear

needs_onednn = pytest.mark.skipif(
    matmul._ONEDNN_LINEAR is None, reason="this torch build has no oneDNN linear"
)


@needs_onednn
@pytest.mark.parametrize("rows", [3, 4, 17, 64, 300])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_matches_torch_for_any_row_count(rows: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen)
    if layout == "column-major":
        w = w.t().contiguous().t()
    b = torch.randn(200, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    for bias in (None, b):
        got = matmul.onednn_linear(x, w, bias)
        assert got is not None
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_the_weight_is_packed_once_and_repacked_after_an_in_place_change() -> None:
    w = torch.randn(32, 16)
    x = torch.randn(8, 16)
    matmul.onednn_linear(x, w)
    first = w._inf_onednn_packed[1]  # type: ignore[attr-defined]
    matmul.onednn_linear(torch.randn(5, 16), w)
    assert w._inf_onednn_packed[1] is first  # type: ignore[attr-defined]
    with torch.no_grad():
        w.mul_(2.0)
    got = matmul.onednn_linear(x, w)
    assert got is not None
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_out_of_scope_inputs_fall_back_to_none() -> None:
    w = torch.randn(16, 64)
    assert matmul.onednn_linear(torch.randn(2, 64), w) is None  # 1-2 rows: the C kernel's
    assert matmul.onednn_linear(torch.randn(8, 64, dtype=torch.float64), w.double()) is None
    assert matmul.onednn_linear(torch.randn(8, 2, 64), w) is None
    assert matmul.onednn_linear(torch.randn(8, 64, requires_grad=True), w) is None


def test_switching_it_off_gives_torch_numbers() -> None:
    w = torch.randn(64, 32)
    x = torch.randn(10, 32)
    matmul.enable_onednn(False)
    try:
        assert matmul.onednn_linear(x, w) is None
        assert torch.equal(linear(x, w), F.linear(x, w))
    finally:
        matmul.enable_onednn(True)


def test_bfloat16_weights_fall_back_to_torch_where_onednn_has_no_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU cannot pack bfloat16 weights for oneDNN: ``bf16_linear`` answers None and ``linear``
    gives ``F.linear``'s numbers (on such a CPU the probe itself answers no; elsewhere it is forced here)."""
    monkeypatch.setattr(matmul, "onednn_bf16_available", lambda: False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(48, generator=gen)
    assert matmul.bf16_linear(x, w) is None
    assert matmul.bf16_linear(x.to(torch.bfloat16), w, keep_bf16=True) is None
    expected = F.linear(x.to(torch.bfloat16), w).float() + b
    torch.testing.assert_close(linear(x, w, b), expected)


def test_the_bf16_probe_agrees_with_the_cpu_flags() -> None:
    from app.engine.kernels.cpu_features import cpu_flags

    flags = cpu_flags()
    if not matmul.onednn_available():
        assert not matmul.onednn_bf16_available()
    elif {"avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert matmul.onednn_bf16_available()
    elif "avx_ne_convert" not in flags and flags:
        assert not matmul.onednn_bf16_available()
