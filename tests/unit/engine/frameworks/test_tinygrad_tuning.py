"""The tinygrad products' register tiles (app.engine.frameworks.tinygrad.tuning): sized for the vector width the CPU
has, and exact whatever tile a product gets, on any CPU (the tile changes the loop order, never the sums' order)."""

from __future__ import annotations

import importlib.util
import shutil
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("tinygrad") is None:
    pytest.skip("tinygrad is not installed (pip install 'inf-engine[tinygrad]')", allow_module_level=True)
if shutil.which("clang") is None:
    pytest.skip("tinygrad's CPU device needs clang", allow_module_level=True)

from app.engine.frameworks.tinygrad import tuning

# SmolLM2's shapes: 576 inputs; 960 (q|k|v), 3072 (gate|up) or 49152 (the head) outputs, in 16-float panels
HIDDEN = 576


@pytest.mark.parametrize(
    ("bits", "rows", "sums", "tile"),
    [
        (256, 64, 1, (4, 1)),  # 4 rows x 16 floats = 8 ymm sums
        (256, 64, 2, (2, 1)),  # SwiGLU keeps two sums per output
        (256, 1, 1, (1, 4)),  # one row streams 4 panels at once
        (512, 64, 1, (8, 1)),  # 8 zmm sums
        (512, 64, 2, (4, 1)),
        (512, 1, 1, (1, 4)),  # one row keeps 256-bit vectors (see _prefer_512_bit_vectors)
        (512, 12, 1, (4, 1)),  # the largest tile that divides the rows
    ],
)
def test_tiles_fill_eight_vector_registers(
    bits: int, rows: int, sums: int, tile: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "vector_bits", lambda: bits)
    group, row_tile, panel_tile = tuning.product_opts(rows, 3072 // tuning.PANEL, HIDDEN, sums)
    assert (row_tile, panel_tile) == tile
    assert group == 3072 // tuning.PANEL  # a layer's weight is one group
    assert row_tile * panel_tile * tuning.PANEL * sums <= 8 * bits // 32


def test_small_weights_get_no_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "vector_bits", lambda: 512)
    assert tuning.product_opts(64, 4, 64) == (4, 0, 1)


def test_the_vector_width_follows_the_avx512_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "avx512_enabled", lambda: False)
    tuning.vector_bits.cache_clear()
    try:
        assert tuning.vector_bits() == 256
        monkeypatch.setattr(tuning, "avx512_enabled", lambda: True)
        tuning.vector_bits.cache_clear()
        assert tuning.vector_bits() == 512
    finally:
        tuning.vector_bits.cache_clear()


@pytest.mark.parametrize("bits", [256, 512])
@pytest.mark.parametrize("rows", [64, 8, 1])
def test_products_are_exact_with_either_width_tiles(bits: int, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels each width's tiles compile to (on this CPU, whatever it has) equal float64 sums to float32
    rounding, with SwiGLU's two sums, a bias and a residual."""
    from tinygrad import Tensor

    from app.engine.frameworks.tinygrad import layers

    tuning.configure()
    monkeypatch.setattr(tuning, "vector_bits", lambda: bits)
    rng = np.random.default_rng(rows)
    out, k = 1024, 256  # 1 MB: the weight gets a register tile
    weight, up = (rng.standard_normal((out, k), dtype=np.float32) for _ in range(2))
    bias = rng.standard_normal(out, dtype=np.float32)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    residual = rng.standard_normal((rows, out), dtype=np.float32)
    panels, up_panels = Tensor(layers.panels(weight)), Tensor(layers.panels(up))
    plain = layers.product(Tensor(x), panels, out, bias=Tensor(bias), residual=Tensor(residual)).numpy()
    gated = layers.product(Tensor(x), panels, out, gate=up_panels).numpy()
    x64 = x.astype(np.float64)
    expect = x64 @ weight.T.astype(np.float64) + bias + residual
    g = x64 @ weight.T.astype(np.float64)
    expect_gated = g / (1 + np.exp(-g)) * (x64 @ up.T.astype(np.float64))
    # float32 sums of 256 terms: within 1e-5 of the largest output (a tile that dropped or repeated a term, or read
    # another row's input, would be off by whole terms)
    assert np.abs(plain - expect).max() <= 1e-5 * np.abs(expect).max()
    assert np.abs(gated - expect_gated).max() <= 1e-5 * np.abs(expect_gated).max()


def test_only_products_of_several_rows_compile_with_512_bit_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag goes to the products of more than two rows and nothing else (installed here whatever the CPU: on
    one without AVX-512, ``-march=native`` gives clang no 512-bit registers and the flag changes nothing)."""
    from tinygrad.runtime.support import compiler_cpu

    tuning.configure()
    tuning._prefer_512_bit_vectors()
    calls: list[list[str]] = []
    run = compiler_cpu.subprocess.check_output

    def spy(args: list[str], **kwargs: Any) -> bytes:
        calls.append(list(args))
        out: bytes = run(args, **kwargs)
        return out

    monkeypatch.setattr(compiler_cpu.subprocess, "check_output", spy)
    compiler = compiler_cpu.ClangCompiler(["x86_64", "native"])
    assert "_v512" in str(compiler.cachekey)  # objects compiled before the change are not reused
    for name in (f"{tuning.PRODUCT_PREFIX}8_576_960", f"{tuning.PRODUCT_PREFIX}1_576_960", "attn_scores_8_128"):
        compiler.compile(f"void {name}(float* out) {{ out[0] = 1.0f; }}")
    wide = ["-mprefer-vector-width=512" in args for args in calls]
    assert wide == [True, False, False]


def test_a_compiler_made_before_the_change_compiles_as_before() -> None:
    """A ClangCompiler built before :func:`tuning._prefer_512_bit_vectors` ran (tinygrad's CPU device opened before the
    runner's import) has no wide flags: its products compile with its own, rather than failing."""
    from tinygrad.runtime.support import compiler_cpu

    tuning._prefer_512_bit_vectors()
    early = object.__new__(compiler_cpu.ClangCompiler)
    early.arch, early.args = "x86_64", ["-march=native"]
    assert early.compile(f"void {tuning.PRODUCT_PREFIX}8_576_960(float* out) {{ out[0] = 1.0f; }}")
