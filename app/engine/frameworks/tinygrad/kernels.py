"""The runner's custom tinygrad kernels, written in UOps: each is one loop nest carrying its own optimizations (so
tinygrad's worker processes, which compile in fresh interpreters, apply them too); :mod:`.tuning` picks their sizes.

* :func:`product_kernel`: ``x @ W.T (+ b)`` against panel weights (see :class:`.layers.Linear`);
* :func:`gather_rows_kernel`: ``table[index]`` (tinygrad's indexing of a large table reads all of it);
* :func:`kv_write_kernel`: the step's keys and values into their cache slots (a scatter: tinygrad's advanced setitem
  would rewrite the whole cache);
* :func:`attention_scores_kernel` and :func:`attention_values_kernel`: paged attention straight from the block
  cache, through each row's block table. The scores kernel skips the blocks past a row's position (a gated load:
  no memory traffic for the padding of its table).

Cache layouts (layer ``l``, block ``b``, offset ``o`` in the block, kv head ``h``, dimension ``d``): keys ``[layers,
blocks, kv_heads, head_dim, block_size]`` (a block's keys for one head and dimension are contiguous, so its scores
are one vector product), values ``[layers, blocks, kv_heads, block_size, head_dim]``; a block's keys (values) for
one kv head are one contiguous 4 KB run (SmolLM2), read in order. The layer comes from an int32 ``[1]`` tensor, so
one compiled layer serves every layer.

Loop order and register tiles: tinygrad orders a kernel's loops by their axis ids, and the registers of an upcast
(unrolled) loop by the same ids, smallest fastest; a partly upcast loop gets a new, largest id. The ids below are
chosen for that: the loops left are nested outermost-first, and the loop that walks contiguous memory varies
fastest in the tile, where clang vectorises it.
"""

from __future__ import annotations

from typing import Any

from tinygrad import UOp
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from app.engine.frameworks.tinygrad.tuning import PRODUCT_PREFIX

__all__ = [
    "attention_scores_kernel",
    "attention_values_kernel",
    "gather_rows_kernel",
    "kv_write_kernel",
    "product_kernel",
]


def _size(r: UOp) -> int:
    return int(r.src[0].arg)


def _info(name: str, loops: list[UOp], upcasts: list[tuple[UOp, Any]]) -> KernelInfo:
    """KernelInfo upcasting output loop ``r`` by ``amount`` for each pair, in order. tinygrad numbers the output loops
    of size > 1 by axis id and drops a loop once it is fully upcast; an amount that does not divide is skipped."""
    live = sorted((r for r in loops if _size(r) > 1), key=lambda r: r.arg[0])
    opts = []
    for r, amount in upcasts:
        if r not in live or amount <= 1 or _size(r) % amount:
            continue
        opts.append(Opt(OptOps.UPCAST, live.index(r), amount))
        if amount == _size(r):
            live.remove(r)
    return KernelInfo(name=name, opts_to_apply=tuple(opts))


def _bounded(index: UOp, size: Any, like: UOp) -> UOp:
    """A loaded index clamped to ``[0, size)``: its bounds let tinygrad drop the per-element wrap-around (modulo) it
    puts on indices it cannot bound; the data keep it in range anyway."""
    return index.cast(like.dtype).maximum(0).minimum(size - 1)


def _vector_load(buf: UOp, start: UOp, lanes: int) -> UOp:
    """``lanes`` consecutive floats of ``buf`` from flat index ``start``, as one vector load (index its lanes with
    ``.index(i)``). Written out because clang does not merge the element loads when the index depends on a loaded
    value (a block id): it sign-extends each element's 32-bit index and loads them one at a time."""
    return UOp(Ops.SHRINK, src=(buf.flatten(), start, UOp.const(lanes))).load(dtype=buf.dtype)


def product_kernel(
    out: UOp,
    x: UOp,
    w: UOp,
    *extra: UOp,
    group: int,
    row_tile: int,
    panel_tile: int = 1,
    parts: tuple[str, ...] = (),
) -> UOp:
    """``out[t, n] = sum_k x[t, k] * w[n // P, k, n % P]`` for panels ``w [n_panels, K, P]``, one float32 sum per
    output in order of ``k``, then the epilogue ``parts`` name, each reading the next of ``extra`` in this order:
    ``"scale"`` (times ``scale[t]``: a norm folded into the weights), ``"gate"`` (``silu(sum) * up`` with the same
    sum over a second panel weight ``up``: SwiGLU), ``"bias"`` (plus ``bias[n]``), ``"residual"`` (plus
    ``residual[t, n]``). Loops: groups of ``group`` panels, rows, panels in the group; the tile is ``row_tile``
    rows (0: no tile) x ``panel_tile`` panels."""
    rows, n = out.shape
    n_panels, k, p = w.shape
    r = UOp.range(k, 0, axis_type=AxisType.REDUCE)
    outer, t, inner, j = (UOp.range(s, i + 1) for i, s in enumerate((n_panels // group, rows, group, p)))
    nb = outer * group + inner
    col = nb * p + j
    sources = dict(zip(parts, extra, strict=True))
    acc = (x[t, r] * w[nb, r, j]).reduce(r, arg=Ops.ADD)
    if "scale" in sources:
        acc = acc * sources["scale"][t]
    if "gate" in sources:
        up = (x[t, r] * sources["gate"][nb, r, j]).reduce(r, arg=Ops.ADD)
        acc = acc.silu() * (up * sources["scale"][t] if "scale" in sources else up)
    if "bias" in sources:
        acc = acc + sources["bias"][col]
    if "residual" in sources:
        acc = acc + sources["residual"][t, col]
    upcasts = [(j, p), (t, row_tile), (inner, panel_tile)] if row_tile else []
    info = _info(f"{PRODUCT_PREFIX}{rows}_{k}_{n}", [outer, t, inner, j], upcasts)
    return out[t, col].store(acc).end(outer, t, inner, j).sink(arg=info)


def gather_rows_kernel(out: UOp, table: UOp, index: UOp) -> UOp:
    """``out[t] = table[index[t]]`` (rows)."""
    rows, width = out.shape
    t, d = UOp.range(rows, 0), UOp.range(width, 1)
    row = _bounded(index[t], table.shape[0], t)
    info = KernelInfo(name=f"gather_{rows}_{width}", opts_to_apply=())
    return out[t, d].store(table[row, d]).end(t, d).sink(arg=info)


def kv_write_kernel(k_cache: UOp, v_cache: UOp, k_new: UOp, v_new: UOp, slots: UOp, layer: UOp) -> UOp:
    """Row ``t`` of ``k_new``/``v_new [T, kv_heads * head_dim]`` into cache slot ``slots[t]`` of layer
    ``layer[0]``."""
    layers, blocks, kv_heads, head_dim, block_size = k_cache.shape
    rows = k_new.shape[0]
    t, h, d = UOp.range(rows, 0), UOp.range(kv_heads, 1), UOp.range(head_dim, 2)
    lay = _bounded(layer[0], layers, t)
    slot = _bounded(slots[t], blocks * block_size, t)
    block, offset = slot // block_size, slot % block_size
    col = h * head_dim + d
    stores = UOp.group(
        k_cache[lay, block, h, d, offset].store(k_new[t, col]),
        v_cache[lay, block, h, offset, d].store(v_new[t, col]),
    )
    return stores.end(t, h, d).sink(arg=KernelInfo(name="kv_write", opts_to_apply=()))


def attention_scores_kernel(
    out: UOp, q: UOp, k_cache: UOp, tables: UOp, positions: UOp, layer: UOp, *, scale: float, lanes: int, heads: int
) -> UOp:
    """``out[t, h, g, w * bs + o] = scale * q[t, h, g] . key(tables[t, w], o, h)`` for ``q [T, kv_heads, group,
    head_dim]``; blocks past row ``t``'s position are not read (their scores are 0: the caller masks them). Tile:
    ``lanes`` keys of a block (fastest) x ``heads`` query heads of the group."""
    rows, kv_heads, group, _ = out.shape
    layers, blocks, _, head_dim, block_size = k_cache.shape
    width = tables.shape[1]
    d = UOp.range(head_dim, 0, axis_type=AxisType.REDUCE)
    o, g = UOp.range(block_size, 1), UOp.range(group, 2)
    t, h, w = UOp.range(rows, 3), UOp.range(kv_heads, 4), UOp.range(width, 5)
    reached = (w * block_size) <= positions[t].cast(w.dtype)
    block = _bounded(layer[0], layers, w) * blocks + _bounded(tables[t, w], blocks, w)
    key = k_cache.reshape(layers * blocks, kv_heads, head_dim, block_size)[block.valid(reached), h, d, o]
    score = (q[t, h, g, d] * key).reduce(d, arg=Ops.ADD) * scale
    info = _info(f"attn_scores_{rows}_{width * block_size}", [t, h, w, g, o], [(o, lanes), (g, heads)])
    return out[t, h, g, w * block_size + o].store(score).end(t, h, w, g, o).sink(arg=info)


def attention_values_kernel(
    out: UOp, weights: UOp, v_cache: UOp, tables: UOp, layer: UOp, *, lanes: int, heads: int
) -> UOp:
    """``out[t, h, g] = sum_j e_j value(j) / sum_j e_j`` over the key positions ``j`` of row ``t``'s table, for
    unnormalised softmax weights ``e [T, kv_heads, group, W * bs]`` (0 where masked): the softmax's division is done
    here, once per output. Every block of the table is read (the scratch block pads it), so the inner loop has no
    branch. Each step loads ``lanes`` dimensions of one value row as a vector; tile: those lanes x ``heads`` query
    heads of the group."""
    rows, kv_heads, group, head_dim = out.shape
    layers, blocks, _, block_size, _ = v_cache.shape
    width = tables.shape[1]
    lanes = lanes if lanes > 1 and head_dim % lanes == 0 else 1
    w = UOp.range(width, 10, axis_type=AxisType.REDUCE)
    o = UOp.range(block_size, 11, axis_type=AxisType.REDUCE)
    t, h, dc, g = (UOp.range(s, i + 1) for i, s in enumerate((rows, kv_heads, head_dim // lanes, group)))
    block = _bounded(layer[0], layers, w) * blocks + _bounded(tables[t, w], blocks, w)
    row = (block * kv_heads + h) * block_size + o
    value = _vector_load(v_cache, row * head_dim + dc * lanes, lanes)
    e = weights[t, h, g, w * block_size + o]
    total = e.reduce(w, o, arg=Ops.ADD)
    sums = [(e * value.index(i)).reduce(w, o, arg=Ops.ADD) for i in range(lanes)]
    stores = UOp.group(*(out[t, h, g, dc * lanes + i].store(acc / total) for i, acc in enumerate(sums)))
    info = _info(f"attn_values_{rows}_{width * block_size}", [t, h, dc, g], [(g, heads)])
    return stores.end(t, h, dc, g).sink(arg=info)
