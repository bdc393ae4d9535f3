"""How tinygrad compiles and runs our kernels on the CPU: the settings this runner needs, set in code (users set
nothing), and the register tile of its matrix products.

tinygrad 0.14 runs CPU kernels from C compiled by clang, on one thread. Measured on SmolLM2's shapes (64 rows x 576 x
1536) on the test machine's Zen 3 cores, three things decide how fast the matrix products run:

* **Weight layout** (:class:`~app.engine.frameworks.tinygrad.layers.Linear`): a row-major ``[out, in]`` weight reads
  one cache line per reduction step, 6 KB apart (a new page every step); panels ``[out / PANEL, in, PANEL]`` stream
  it in memory order. 16 -> 35 GFLOPS.
* **Vector width**: tinygrad groups contiguous loads into ``float4`` vectors, and clang's SLP vectoriser then keeps
  the accumulators in 128-bit registers. Without that grouping (``DMC=1``) clang vectorises the scalar code itself,
  in 256-bit AVX registers. 35 -> 40-45 GFLOPS.
* **Kernel shape**: tinygrad's default heuristic (made for GPUs first) upcasts the wrong axes of such a product
  (13-18 GFLOPS). The product is a custom kernel carrying its own optimizations (:func:`product_opts`): a register
  tile of up to 4 rows x one panel, eight 256-bit accumulators. They travel with the kernel, so tinygrad's worker
  processes (which compile in parallel, in fresh interpreters) apply them too.

And two process-wide switches, set by :func:`configure` before tinygrad is first imported:

* ``HCQ2=1``: a TinyJit replay becomes one command buffer that tinygrad's CPU worker thread runs, instead of one
  Python call per kernel (a SmolLM2 step has ~500 kernels: ~25 ms of Python per step otherwise). If tinygrad was
  imported before this module, it keeps its mode (correct, only slower per step).
* ``DEV=CPU``: tinygrad's default device, as the runner's tensors and its KV cache (host memory used in place) must
  share one device.

``DMC`` only changes how loads are grouped and ``HCQ2`` how kernels are launched, never a result.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: output columns per weight panel: one 16-float row of a panel is two 256-bit registers
PANEL = 16
#: products whose weight is at least this large get the register tile; smaller ones stay in cache whatever the loop
#: order, and compile faster without it (tinygrad's code generation is slow with large tiles)
TILE_MIN_WEIGHT_BYTES = 1 << 20
#: larger weights (the LM head) are cut into panel groups of at most GROUP_BYTES (see product_opts)
GROUP_MAX_BYTES = 16 << 20
GROUP_BYTES = 4 << 20
_ROW_TILES = (4, 2)

_configured = False


def set_environment() -> None:
    """The environment variables (see the module docstring), without importing tinygrad: the package's
    ``__init__`` calls this, so they are set before any of its modules imports tinygrad."""
    os.environ["DMC"] = "1"
    if "tinygrad" not in sys.modules:  # read once, at tinygrad's import: too late otherwise
        os.environ["HCQ2"] = "1"
        os.environ["DEV"] = "CPU"


def configure() -> None:
    """:func:`set_environment`, and the settings of an already imported tinygrad; idempotent."""
    global _configured
    if _configured:
        return
    set_environment()
    from tinygrad.helpers import DEV, getenv

    DEV.value = "CPU"
    getenv.cache_clear()  # type: ignore[attr-defined]  # tinygrad caches environment reads: DMC is read again at the next compile
    _configured = True


def _upcasts(sizes: tuple[int, ...], wanted: list[tuple[int, int]]) -> tuple[Any, ...]:
    """UPCAST opts for output loops of ``sizes`` (in loop order): ``(loop, amount)`` pairs, applied in that order,
    so the last is innermost in the register tile (put the loop of contiguous memory last: clang then vectorises
    along it). tinygrad numbers only the loops of size > 1 and drops a loop once it is fully upcast."""
    from tinygrad.codegen.opt import Opt, OptOps

    gone = {i for i, s in enumerate(sizes) if s <= 1}
    opts = []
    for i, amount in wanted:
        if i in gone or amount <= 1 or sizes[i] % amount:
            continue
        opts.append(Opt(OptOps.UPCAST, sum(1 for j in range(i) if j not in gone), amount))
        if amount == sizes[i]:
            gone.add(i)
    return tuple(opts)


def product_opts(rows: int, n_panels: int, in_features: int) -> tuple[int, tuple[Any, ...]]:
    """``(group, opts)`` of a ``[rows, in] x [n_panels, in, PANEL]`` product (:func:`.kernels.product_kernel`).

    A weight of at least :data:`TILE_MIN_WEIGHT_BYTES` gets a register tile of up to 4 rows x one panel; one larger
    than :data:`GROUP_MAX_BYTES` (the LM head) is cut into groups of panels that stay in cache while every row
    passes: with rows outermost, the 113 MB head of SmolLM2 was read once per row tile (13 GFLOPS, 27 in groups),
    and groups (or panels outermost) made the products of the layers slower (38 -> 27 GFLOPS)."""
    panel_bytes = in_features * PANEL * 4
    if n_panels * panel_bytes < TILE_MIN_WEIGHT_BYTES:
        return n_panels, ()
    group = n_panels
    if n_panels * panel_bytes > GROUP_MAX_BYTES:
        fits = max(1, GROUP_BYTES // panel_bytes)
        group = max(g for g in range(1, fits + 1) if n_panels % g == 0)
    tile = next((t for t in _ROW_TILES if rows % t == 0), 1)
    return group, _upcasts((n_panels // group, rows, group, PANEL), [(1, tile), (3, PANEL)])


def attention_opts(rows: int, kv_heads: int, blocks: int, group: int, block_size: int, head_dim: int) -> tuple[
    tuple[Any, ...], tuple[Any, ...]
]:
    """Opts of the scores kernel (a block's keys x the head group: loops t, h, w, g, o) and of the values kernel
    (the head group x 16 dimensions: loops t, h, g, d)."""
    lanes = next((n for n in (16, 8, 4, 2) if block_size % n == 0), 1)
    heads = group if group <= 8 else 1
    scores = _upcasts((rows, kv_heads, blocks, group, block_size), [(3, heads), (4, lanes)])
    dims = next((n for n in (16, 8, 4, 2) if head_dim % n == 0), 1)
    values = _upcasts((rows, kv_heads, head_dim, group), [(3, heads), (2, dims)])
    return scores, values
