"""The runner's custom tinygrad kernels, written in UOps: each is one loop nest with the optimizations it carries
(:mod:`.tuning` chooses them), so tinygrad's worker processes compile them the same way.

* :func:`product_kernel`: ``x @ W.T (+ b)`` against panel weights (see :class:`.layers.Linear`);
* :func:`gather_rows_kernel`: ``table[index]`` (tinygrad's indexing of a large table reads all of it);
* :func:`kv_write_kernel`: the step's keys and values into their cache slots (a scatter: tinygrad's advanced setitem
  would rewrite the whole cache);
* :func:`attention_scores_kernel` and :func:`attention_values_kernel`: paged attention straight from the block
  cache, through each row's block table, reading only the blocks its position reaches (a gated load: no memory
  traffic for the rest of the padded table).

Cache layouts (block ``b``, offset ``o`` in the block, kv head ``h``, dimension ``d``): keys ``[blocks, kv_heads,
head_dim, block_size]`` (a block's keys for one head and dimension are contiguous: the scores of a block are one
vector product), values ``[blocks, block_size, kv_heads, head_dim]`` (one contiguous row per slot).
"""

from __future__ import annotations

from typing import Any

from tinygrad import UOp
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

__all__ = [
    "attention_scores_kernel",
    "attention_values_kernel",
    "gather_rows_kernel",
    "kv_write_kernel",
    "product_kernel",
]


def _info(name: str, opts: tuple[Any, ...]) -> KernelInfo:
    return KernelInfo(name=name, opts_to_apply=opts)


def _bounded(index: UOp, size: Any, like: UOp) -> UOp:
    """A loaded index clamped to ``[0, size)``: its bounds let tinygrad drop the per-element wrap-around (64-bit
    modulo) it puts on indices it cannot bound; the data keep it in range anyway."""
    return index.cast(like.dtype).maximum(0).minimum(size - 1)


def product_kernel(out: UOp, x: UOp, w: UOp, *bias: UOp, group: int, opts: tuple[Any, ...]) -> UOp:
    """``out[t, n] = sum_k x[t, k] * w[n // P, k, n % P] (+ bias[n])`` for panels ``w [n_panels, K, P]``, one float32
    sum per output in order of ``k``. Loops: panel groups of ``group`` panels, rows, panels in the group, columns."""
    rows, n = out.shape
    n_panels, k, p = w.shape
    r = UOp.range(k, 0, axis_type=AxisType.REDUCE)
    outer, t, inner, j = (UOp.range(s, i + 1) for i, s in enumerate((n_panels // group, rows, group, p)))
    nb = outer * group + inner
    acc = (x[t, r] * w[nb, r, j]).reduce(r, arg=Ops.ADD)
    if bias:
        acc = acc + bias[0][nb * p + j]
    return out[t, nb * p + j].store(acc).end(outer, t, inner, j).sink(arg=_info(f"product_{rows}_{k}_{n}", opts))


def gather_rows_kernel(out: UOp, table: UOp, index: UOp) -> UOp:
    """``out[t] = table[index[t]]`` (rows)."""
    rows, width = out.shape
    t, d = UOp.range(rows, 0), UOp.range(width, 1)
    row = _bounded(index[t], table.shape[0], t)
    return out[t, d].store(table[row, d]).end(t, d).sink(arg=_info(f"gather_{rows}_{width}", ()))


def kv_write_kernel(k_cache: UOp, v_cache: UOp, k_new: UOp, v_new: UOp, slots: UOp) -> UOp:
    """Row ``t`` of ``k_new``/``v_new [T, kv_heads * head_dim]`` into cache slot ``slots[t]`` (layouts: module
    docstring)."""
    _, kv_heads, head_dim, block_size = k_cache.shape
    rows = k_new.shape[0]
    t, h, d = UOp.range(rows, 0), UOp.range(kv_heads, 1), UOp.range(head_dim, 2)
    slot = _bounded(slots[t], k_cache.shape[0] * block_size, t)
    block, offset = slot // block_size, slot % block_size
    col = h * head_dim + d
    stores = UOp.group(
        k_cache[block, h, d, offset].store(k_new[t, col]), v_cache[block, offset, h, d].store(v_new[t, col])
    )
    return stores.end(t, h, d).sink(arg=_info("kv_write", ()))


def attention_scores_kernel(
    out: UOp, q: UOp, k_cache: UOp, tables: UOp, positions: UOp, *, scale: float, opts: tuple[Any, ...]
) -> UOp:
    """``out[t, h, g, w * bs + o] = scale * q[t, h, g] . key(tables[t, w], o, h)`` for ``q [T, kv_heads, group,
    head_dim]``; blocks past row ``t``'s position are not read (their scores are 0: the caller masks them)."""
    rows, kv_heads, group, _ = out.shape
    _, _, head_dim, block_size = k_cache.shape
    width = tables.shape[1]
    d = UOp.range(head_dim, 0, axis_type=AxisType.REDUCE)
    t, h, w, g, o = (UOp.range(s, i + 1) for i, s in enumerate((rows, kv_heads, width, group, block_size)))
    reached = (w * block_size) <= positions[t].cast(w.dtype)
    key = k_cache[_bounded(tables[t, w], k_cache.shape[0], w).valid(reached), h, d, o]
    score = (q[t, h, g, d] * key).reduce(d, arg=Ops.ADD) * scale
    name = f"attn_scores_{rows}_{width * block_size}"
    return out[t, h, g, w * block_size + o].store(score).end(t, h, w, g, o).sink(arg=_info(name, opts))


def attention_values_kernel(
    out: UOp, probs: UOp, v_cache: UOp, tables: UOp, positions: UOp, *, opts: tuple[Any, ...]
) -> UOp:
    """``out[t, h, g] = sum_j probs[t, h, g, j] * value(j)`` over the key positions ``j`` of row ``t``'s table;
    blocks past its position are not read."""
    rows, kv_heads, group, head_dim = out.shape
    _, block_size, _, _ = v_cache.shape
    width = tables.shape[1]
    w = UOp.range(width, 0, axis_type=AxisType.REDUCE)
    o = UOp.range(block_size, 1, axis_type=AxisType.REDUCE)
    t, h, d, g = (UOp.range(s, i + 2) for i, s in enumerate((rows, kv_heads, head_dim, group)))
    value = v_cache[_bounded(tables[t, w], v_cache.shape[0], w), o, h, d]
    acc = (probs[t, h, g, w * block_size + o] * value).reduce(w, o, arg=Ops.ADD)
    name = f"attn_values_{rows}_{width * block_size}"
    return out[t, h, g, d].store(acc).end(t, h, d, g).sink(arg=_info(name, opts))
