"""How the runner has tinygrad compile its kernels on the CPU, and the process-wide settings it makes (in code: users
set nothing, no environment variable is read).

tinygrad 0.14 runs CPU kernels from C compiled by clang, one kernel after the other on the launching thread.
Measured on SmolLM2's shapes (64 rows x 576 x 1536, one Zen 3 core of the test machine), three things decide how
fast the matrix products run:

* **Weight layout** (:class:`~app.engine.frameworks.tinygrad.layers.Linear`): a row-major ``[out, in]`` weight reads
  one cache line per reduction step, 6 KB apart (a new page every step); panels ``[out / PANEL, in, PANEL]`` stream
  it in memory order: 16 -> 35 GFLOPS.
* **Kernel shape**: tinygrad's default heuristic (made for GPUs first) upcasts the wrong axes of such a product
  (13-18 GFLOPS). Our kernels are custom UOp kernels (:mod:`.kernels`) carrying their own optimizations: a register
  tile of up to 4 rows x one panel for the products (sizes: :func:`product_opts`).
* **Vector width**: tinygrad groups contiguous loads into ``float4`` vectors, and clang then keeps the sums in
  128-bit registers. :func:`configure` leaves the loads of the product kernels alone (a wrapper around tinygrad's
  ``memory_coalescing`` pass, by kernel name), and clang vectorises them in 256-bit registers: ~30 -> ~40 GFLOPS.
  Every other kernel keeps the grouping: the attention kernels' rows are addressed through the block table, and
  without ``float4`` loads clang loads them one float at a time (6x slower). tinygrad's process-wide ``DMC=1`` would
  do the first and not the second. The wrapper exists in this process only, so the runner compiles its captures
  here (``Context(PARALLEL=0)``) rather than in tinygrad's worker processes (fresh interpreters): those would
  compile the products with ``float4`` loads, with the same results, more slowly. On AVX-512 CPUs the products of
  more than two rows get 512-bit registers and 8-row tiles (:func:`_prefer_512_bit_vectors`): 1.6x on a Xeon.

Left out: ``HCQ2=1`` (a TinyJit replay as one command buffer) removes the per-kernel Python dispatch (~50 us a
kernel), but its host waits spin, which on a busy 2-core machine takes the core the kernels need, and it is read once,
when tinygrad is imported (``app.engine.frameworks.build_runner`` imports tinygrad before this package).

:func:`configure` also pins tinygrad's default device to ``CPU``: the runner's tensors and its KV cache (host memory
used in place) must share one device.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from app.engine.kernels.cpu_features import avx512_enabled

#: output columns per weight panel: one 16-float row of a panel is two 256-bit registers
PANEL = 16
#: the names of the product kernels (:func:`.kernels.product_kernel`), whose loads are left ungrouped
PRODUCT_PREFIX = "product_"
#: products whose weight is at least this large get the register tile; smaller ones stay in cache whatever the loop
#: order, and compile faster without it (tinygrad's code generation is slow with large tiles)
TILE_MIN_WEIGHT_BYTES = 1 << 20
#: larger weights (the LM head) are cut into panel groups of at most GROUP_BYTES (see product_opts)
GROUP_MAX_BYTES = 16 << 20
GROUP_BYTES = 4 << 20
#: the register tiles tried, largest first (rows of a tile; panels of a tile for one or two rows)
_ROW_TILES = (8, 4, 2)
_PANEL_TILES = (8, 4, 2)
#: a tile's sums fill at most this many vector registers: enough independent sums to keep both FMA units busy, few
#: enough that clang keeps them all in registers (16 ymm without AVX-512; 32 zmm with it)
_SUM_REGISTERS = 8

_configured = False
#: a product kernel's name in its C source, with its row count (see :func:`.kernels.product_kernel`)
_PRODUCT_ROWS = re.compile(rf"\b{PRODUCT_PREFIX}(\d+)_\d+_\d+\b")


def configure() -> None:
    """Pin tinygrad's default device to the CPU, and keep the loads of our product kernels ungrouped (see the module
    docstring); idempotent."""
    global _configured
    if _configured:
        return
    import tinygrad.codegen as codegen
    from tinygrad.helpers import DEV

    DEV.value = "CPU"
    grouped = getattr(codegen, "memory_coalescing", None)
    if grouped is not None:  # (a tinygrad without it compiles the products with float4 loads: correct, slower)

        def memory_coalescing(sink: Any, ctx: Any) -> Any:
            name = getattr(sink.arg, "name", "")
            return sink if isinstance(name, str) and name.startswith(PRODUCT_PREFIX) else grouped(sink, ctx)

        codegen.memory_coalescing = memory_coalescing  # type: ignore[assignment]
    _per_thread_disk_cache()
    if vector_bits() == 512:
        _prefer_512_bit_vectors()
    _configured = True


@functools.cache
def vector_bits() -> int:
    """The vector width the product tiles are sized for: 512 where our kernels may use AVX-512 (see
    :func:`app.engine.kernels.cpu_features.avx512_enabled`), else 256."""
    return 512 if avx512_enabled() else 256


def _prefer_512_bit_vectors() -> None:
    """Have clang vectorise the products of several rows with 512-bit registers. With ``-march=native`` alone it
    keeps to 256-bit ones on AVX-512 CPUs (a tuning default for their clock), and a tile of 8 rows x one 16-float
    panel then needs 16 ymm sums: in 512-bit registers it is 8 zmm, and those products ran 1.6x faster in a decode
    step of SmolLM2 (a Xeon with AVX-512, 2 threads of 32 rows). Products of one or two rows stream their weight
    and were slower with 512-bit vectors (13.5 -> 11.4 tok/s single stream), so they and every other kernel keep
    the default. The compile cache key names the change, so no object compiled otherwise is reused."""
    from tinygrad.runtime.support import compiler_cpu

    clang = compiler_cpu.ClangCompiler
    if getattr(clang, "_prefers_512", False):
        return
    plain_init, plain_compile = clang.__init__, clang.compile

    def init(self: Any, arch: list[str], cachekey: str = "compile_clang_obj") -> None:
        plain_init(self, arch, f"{cachekey}_v512")
        self.wide_args = [*self.args, "-mprefer-vector-width=512"]

    def compile(self: Any, src: str) -> bytes:
        found = _PRODUCT_ROWS.search(src)
        wide = getattr(self, "wide_args", None)  # None: a compiler made before the patch (its device opened early)
        if found is None or int(found.group(1)) <= 2 or wide is None:
            return plain_compile(self, src)
        narrow, self.args = self.args, wide
        try:
            return plain_compile(self, src)
        finally:
            self.args = narrow

    clang.__init__ = init  # type: ignore[method-assign]
    clang.compile = compile  # type: ignore[method-assign]
    clang._prefers_512 = True  # type: ignore[attr-defined]


def _per_thread_disk_cache() -> None:
    """Give each thread its own connection to tinygrad's compile cache (SQLite): tinygrad keeps one process-wide
    connection, which SQLite refuses to use from any thread but the one that opened it, and the runner compiles on
    the engine's thread and replays on its shard threads (CI saw ``ProgrammingError`` once a test thread had opened
    it first)."""
    from tinygrad import helpers

    opened = helpers.db_connection
    local = threading.local()
    lock = threading.Lock()

    def db_connection() -> Any:
        connection = getattr(local, "connection", None)
        if connection is None:
            with lock:  # the original caches its connection in a module global: open ours with that global unset
                helpers._db_connection = None
                connection = local.connection = opened()
                helpers._db_connection = None
        return connection

    helpers.db_connection = db_connection


def product_opts(rows: int, n_panels: int, in_features: int, sums: int = 1) -> tuple[int, int, int]:
    """``(group, row_tile, panel_tile)`` of a ``[rows, in] x [n_panels, in, PANEL]`` product of ``sums`` sums per
    output (:func:`.kernels.product_kernel`).

    A weight of at least :data:`TILE_MIN_WEIGHT_BYTES` gets a register tile of up to 8 rows (4 without AVX-512) x one panel (row tile
    0: no tile); one larger than :data:`GROUP_MAX_BYTES` (the LM head) is cut into groups of panels that stay in
    cache while every row passes: with rows outermost, the 113 MB head of SmolLM2 was read once per row tile (13
    GFLOPS, 27 in groups), and groups (or panels outermost) made the products of the layers slower (38 -> 27)."""
    panel_bytes = in_features * PANEL * 4
    if n_panels * panel_bytes < TILE_MIN_WEIGHT_BYTES:
        return n_panels, 0, 1
    group = n_panels
    # (one row reads the weight once anyway; and tinygrad would merge the group loops back into one)
    if rows > 1 and n_panels * panel_bytes > GROUP_MAX_BYTES:
        fits = max(1, GROUP_BYTES // panel_bytes)
        group = max(g for g in range(1, fits + 1) if n_panels % g == 0)
    # at most _SUM_REGISTERS vectors of sums (64 floats in 256-bit registers; beyond, clang spills them): a SwiGLU
    # product keeps two sums per output (4 rows of it ran at 9 GFLOPS, 2 rows at 31, on 256-bit registers)
    budget = _SUM_REGISTERS * (vector_bits() if rows > 2 else 256) // 32  # (see _prefer_512_bit_vectors)
    row_tile = next((t for t in _ROW_TILES if rows % t == 0 and t * PANEL * sums <= budget), 1)
    # a row or two streams the weight: several panels per step keep independent sums in flight (one panel's sums
    # wait on the previous step's: the weight streamed at 3-7 GB/s, 7-9 with four panels)
    panel_tile = next(
        (t for t in _PANEL_TILES if rows <= 2 and group % t == 0 and t * row_tile * PANEL * sums <= budget), 1
    )
    return group, row_tile, panel_tile


def attention_tiles(group: int, block_size: int, head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(lanes, heads)`` of the scores kernel (keys of a block x query heads of a group) and of the values kernel
    (dimensions x query heads)."""
    heads = 1
    keys = next((n for n in (16, 8, 4, 2) if block_size % n == 0), 1)
    dims = next((n for n in (32, 16, 8, 4, 2) if head_dim % n == 0), 1)
    return (keys, heads), (dims, heads)
