"""A dense copy of the decode batch's KV context, so decode steps read it with plain batched products.

XLA on CPU materialises a gather of cache blocks element by element; gathering every sequence's blocks in every
layer of every decode step cost more than the rest of the attention together. Decoding sequences stay in the
batch for many steps, so the runner keeps, beside the paged cache, one row per running sequence of
``K^T [kv_heads, rows, head_dim, width]`` and ``V [kv_heads, rows, width, head_dim]``: a decode step appends
each row's new key and value (and writes the paged cache, which stays the source of truth), then attends over
its row as is. A row is (re)filled from the paged cache, once, when its sequence joins the batch or comes back
after a mixed step or a preemption; the arrays are reallocated when the batch outgrows their rows.

The width follows the longest context in steps of :func:`~app.engine.frameworks.buckets.context_bucket` (1, 1.5,
2, 3, 4, 6, ... times the narrowest), not powers of two: a decode reads its rows' whole width, and the attention of a 64-row SmolLM2 step
is 0.2 ms a layer at 64 tokens against 1.6 ms at 256. Widening pads the arrays and narrowing (to half the width
or less) cuts them, both keeping every row's keys, so neither refills from the paged cache.

Batch row ``i`` of a mirrored decode step IS mirror row ``i``: free rows run as padding (they write position 0
of their own free row and a scratch slot of the paged cache), so no row is ever gathered or scattered by index.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from app.engine.core.sequence import Sequence
from app.engine.frameworks.buckets import pow2_bucket
from app.engine.frameworks.jax.layers import MASKED, Array, gather_blocks, jitted

Mirror = list[tuple[Array, Array]]  # per layer: K^T [kvh, rows, d, width], V [kvh, rows, width, d]

_traces = [0]  # traces of the refill function (added to the runner's num_compilations)


def dense_decode_attention(q: Array, k_t: Array, v: Array, context_lens: Array, scale: float) -> Array:
    """``q [R, heads, d]`` against mirror rows ``K^T [kvh, R, d, C]``, ``V [kvh, R, C, d]`` (their first
    ``context_lens`` positions); returns ``[R, heads * d]``."""
    rows, num_heads, head_dim = q.shape
    kv_heads, width = k_t.shape[0], k_t.shape[3]
    qg = q.reshape(rows, kv_heads, num_heads // kv_heads, head_dim).transpose(1, 0, 2, 3)
    scores = jnp.einsum("kbgd,kbdc->kbgc", qg, k_t) * scale
    keep = jnp.arange(width)[None, :] < context_lens[:, None]
    probs = jax.nn.softmax(jnp.where(keep[None, :, None, :], scores, MASKED), axis=-1)
    out = jnp.einsum("kbgc,kbcd->kbgd", probs, v)
    return out.transpose(1, 0, 2, 3).reshape(rows, num_heads * head_dim)


def append_rows(k_t: Array, v: Array, positions: Array, k: Array, v_new: Array) -> tuple[Array, Array]:
    """Row ``i``'s new key and value ``[R, kvh, d]`` at its position ``positions[i]``."""
    rows = jnp.arange(k_t.shape[1])
    k_t = k_t.at[:, rows, :, positions].set(k, mode="promise_in_bounds")  # indexed dims lead: [R, kvh, d]
    v = v.at[:, rows, positions].set(v_new.transpose(1, 0, 2), mode="promise_in_bounds")
    return k_t, v


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_buffers() -> bool:
    """Have glibc keep freed buffers of up to 32 MiB in the heap for the next ones, process-wide; True if it took.

    XLA's CPU buffers come from malloc, and glibc gives each large one a fresh mapping that it unmaps on free, so
    every byte of a resized mirror, and of each step's logits (12.6 MB at 64 rows), page-faults: 0.22-0.26 s per
    resize of a 64-row SmolLM2 mirror, 1.0 s of a 19.6 s workload A on a 2-core AMD EPYC. With the mmap threshold
    at glibc's largest and the heap trimmed only past 1 GiB free, the four resizes of that run take 0.11-0.13 s
    together and the run 17.5 s (a 512 MiB trim threshold: 0.12-0.33 s and 18.3-19.9 s). The price is up to
    1 GiB of freed heap kept by the process. Not on other C libraries or systems."""
    if sys.platform != "linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def _resize_layer(mirror: tuple[Array, Array], *, width: int) -> tuple[Array, Array]:
    """One layer's mirror at ``width`` positions: padded with zeros past the old width, or cut to it."""
    _traces[0] += 1
    k_t, v = mirror
    old = k_t.shape[3]
    if width <= old:
        return k_t[..., :width], v[:, :, :width]
    return (
        jnp.pad(k_t, ((0, 0), (0, 0), (0, 0), (0, width - old))),
        jnp.pad(v, ((0, 0), (0, 0), (0, width - old), (0, 0))),
    )


def _refill_layer(
    mirror: tuple[Array, Array], cache: tuple[Array, Array], rows: Array, tables: Array, *, block_size: int
) -> tuple[Array, Array]:
    """Copy one layer's paged context of ``tables [n, W]`` into its mirror ``rows [n]`` (a row past the end:
    padding, dropped). One layer at a time: a single small compiled function serves every layer."""
    _traces[0] += 1
    keys = gather_blocks(cache[0], tables, block_size)  # [kvh, n, W * bs, d]
    values = gather_blocks(cache[1], tables, block_size)
    k_t = mirror[0].at[:, rows].set(keys.transpose(0, 1, 3, 2), mode="drop")
    return k_t, mirror[1].at[:, rows].set(values, mode="drop")


@dataclass
class MirrorPlan:
    """Where one decode step's sequences sit in the mirror."""

    rows: np.ndarray  # the mirror row of each scheduled sequence, in scheduled order
    num_rows: int  # the mirror's rows: the step's (padded) batch


class DecodeMirror:
    """The mirror's arrays and which sequence owns which row; at most ``max_bytes`` of arrays (a batch that
    would need more decodes through the paged cache instead)."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        max_bytes: int,
        fast_compile: bool,
    ) -> None:
        self.num_layers = num_layers
        self.fast_compile = fast_compile
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.arrays: Mirror | None = None
        self.num_rows = 0
        self.width = 0  # blocks per row
        self.row_of: dict[int, int] = {}  # seq id -> row
        self.valid = np.zeros(0, dtype=np.int64)  # per row: positions [0, valid) hold its sequence's K/V
        self.num_traces = 0

    def nbytes(self, rows: int, width: int) -> int:
        return 2 * self.num_layers * self.kv_heads * rows * width * self.block_size * self.head_dim * 4

    def forget(self, seq_id: int) -> None:
        """A preempted sequence: its row is free and must be refilled (its K/V will be recomputed)."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.valid[row] = 0

    def plan(
        self, seqs: list[Sequence], starts: np.ndarray, rows: int, width: int, caches: Any
    ) -> MirrorPlan | None:
        """Rows for this decode step's sequences (each at position ``starts[i]``; ``rows`` and ``width`` in
        blocks: the bucketed batch and context the step needs), refilling the rows that miss part of their
        context; None when the mirror would exceed its budget."""
        n = len(seqs)
        present = {s.seq_id for s in seqs}
        for sid in [sid for sid in self.row_of if sid not in present]:  # finished or no longer scheduled
            self.forget(sid)
        if self.arrays is None or rows > self.num_rows or 4 * rows <= self.num_rows:
            if self.nbytes(rows, width) > self.max_bytes:
                self.release()
                return None
            self.allocate(rows, width)
        elif width > self.width or 2 * width <= self.width:
            if self.nbytes(self.num_rows, width) > self.max_bytes:
                self.release()
                return None
            self.resize(width)
        free = iter(sorted(set(range(self.num_rows)) - set(self.row_of.values())))
        assigned = np.empty(n, dtype=np.int64)
        for i, seq in enumerate(seqs):
            row = self.row_of.get(seq.seq_id)
            if row is None:
                row = self.row_of[seq.seq_id] = next(free)
            assigned[i] = row
        stale = self.valid[assigned] < starts
        if stale.any():
            self._refill([s for s, bad in zip(seqs, stale, strict=True) if bad], assigned[stale], caches)
        self.valid[assigned] = starts + 1  # after this step
        return MirrorPlan(assigned, self.num_rows)

    def release(self) -> None:
        self.arrays = None
        self.num_rows = self.width = 0
        self.row_of.clear()
        self.valid = np.zeros(0, dtype=np.int64)

    def allocate(self, rows: int, width: int) -> None:
        """Fresh zeroed arrays of ``rows`` rows of ``width`` blocks, every row free."""
        self.release()  # drop the old arrays first: the peak stays one mirror
        shape_k = (self.kv_heads, rows, self.head_dim, width * self.block_size)
        shape_v = (self.kv_heads, rows, width * self.block_size, self.head_dim)
        self.arrays = [
            (jnp.zeros(shape_k, jnp.float32), jnp.zeros(shape_v, jnp.float32)) for _ in range(self.num_layers)
        ]
        self.num_rows, self.width = rows, width
        self.valid = np.zeros(rows, dtype=np.int64)

    def resize(self, width: int) -> None:
        """Every layer's arrays at ``width`` blocks, the rows' keys and values kept (``width`` covers them)."""
        assert self.arrays is not None
        before = _traces[0]
        resize = jitted(_resize_layer, self.fast_compile, ("width",), ())  # sizes differ: nothing to donate
        tokens = width * self.block_size
        for i, layer in enumerate(self.arrays):  # layer by layer: the old arrays go as the new ones come
            self.arrays[i] = resize(layer, width=tokens)
        self.width = width
        self.num_traces += _traces[0] - before

    def _refill(self, seqs: list[Sequence], rows: np.ndarray, caches: Any) -> None:
        count = pow2_bucket(len(seqs), 8)
        scratch_block = int(caches[0][0].shape[1]) // self.block_size - 1
        tables = np.full((count, self.width), scratch_block, dtype=np.int32)
        for i, seq in enumerate(seqs):
            table = seq.block_table[: self.width]
            tables[i, : len(table)] = table
        padded = np.full(count, self.num_rows, dtype=np.int32)  # past the end: dropped
        padded[: len(seqs)] = rows
        before = _traces[0]
        assert self.arrays is not None
        refill = jitted(_refill_layer, self.fast_compile, ("block_size",), ("mirror",))
        rows_d, tables_d = jax.device_put((padded, tables))
        for i, cache in enumerate(caches):
            self.arrays[i] = refill(self.arrays[i], cache, rows_d, tables_d, block_size=self.block_size)
        self.num_traces += _traces[0] - before
