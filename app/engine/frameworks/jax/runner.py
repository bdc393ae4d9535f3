"""The JAX model runner: one scheduler step → a few jitted calls (embeddings, groups of layers, head) over a paged
KV cache held in JAX arrays.

Per step the scheduled sequences' new tokens are laid end to end (decodes first, then prefill chunks), and the
index arrays (positions, cache slots, block tables, context lengths) are built with numpy, touching each
sequence once. The arrays are padded to bucketed shapes (powers of two for rows, :mod:`..buckets` for context
widths) so that a new batch size reuses a compiled step instead of tracing a new one; ``num_compilations`` counts
the traces. Padding rows write one scratch slot in an extra block that no sequence owns, and padded table entries
point at that block and are masked, so padding never reaches a real row.

Two kinds of step:

* decode-only (every sequence brings one token, the common step): ``[B]`` rows, attention over each sequence's
  row of the decode mirror (:mod:`.mirror`) or through its block table;
* mixed: the one-token sequences attend as in a decode, the multi-token chunks as ``[B, Q]`` query blocks
  (causal within the chunk, the prefix from the cache, which is how prefix caching and chunked prefill read
  earlier tokens).

Either way the head computes logits only for the (padded) rows that sample, and they reach the sampler uncopied.
The KV cache buffers are donated to each call, so XLA updates them in place.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from app.engine.config import ModelConfig
from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.frameworks.buckets import context_bucket
from app.engine.frameworks.buckets import pow2_bucket as bucket
from app.engine.frameworks.jax.layers import (
    FAST_COMPILE_PARAMS,
    Array,
    causal_attention,
    decode_attention,
    jitted,
    prefill_attention,
    write_kv,
)
from app.engine.frameworks.jax.mirror import (
    DecodeMirror,
    MirrorPlan,
    append_rows,
    dense_decode_attention,
    keep_freed_buffers,
)
from app.engine.frameworks.jax.models import (
    ModelSpec,
    Params,
    block,
    compute_logits,
    embed,
    final_norm,
    forward,
    params_from_torch,
)
from app.engine.hidden_states import CaptureStore
from app.engine.model_runner import RunnerTimings
from app.engine.models.base import PagedCausalLM

__all__ = ["JaxRunner", "layer_outputs", "make_runner"]

# Smallest buckets: below these, padding costs less than another compiled shape.
MIN_SEQS = 8
MIN_TOKENS = 16
MIN_QUERIES = 8
MIN_CONTEXT = 64  # tokens: the narrowest block-table width (short contexts share one compiled shape)

# How many step functions were traced in this process (bumped inside the traced bodies, which run once per
# trace); each runner adds the traces its own calls caused to its num_compilations.
_traces = [0]


def decode_rows(n: int, single_row: bool = True) -> int:
    """The padded batch of a decode step: one sequence alone runs one row when ``single_row`` (a float32
    matrix-vector product reads the weights faster than the 8-row product), more are padded to a power of two, at
    least ``MIN_SEQS`` (2 to 8 rows cost about the same). bfloat16 products pass False: YNNPACK's one-row bfloat16
    product is the slow one (a SmolLM2 layer 1.31 ms at 1 row against 0.53 ms at 8, on an AMD EPYC with
    AVX512-BF16; float32 0.61 and 0.71)."""
    return 1 if n == 1 and single_row else bucket(n, MIN_SEQS)


# ---- the traced step functions ---------------------------------------------------------------------------
# A step runs as jitted pieces: the embeddings, then ONE compiled group of blocks called once per group of layers
# (every group has the same shapes, and its weights, caches and mirrors are arguments), then the logits. Compiling
# a group instead of the whole unrolled model makes a new shape several times cheaper to compile (seconds per
# shape for a 30-layer model otherwise); the price is a few dispatches a step, which run ahead of the computation.
# Groups of up to LAYERS_PER_CALL layers rather than one: SmolLM2's workload A with bfloat16 products ran at
# 446-466 tok/s with one layer a call (4 runs) against 461-501 with six (4 runs), on a 2-core AMD EPYC; the first
# run, compilations included, took 19.5 s against 19.9 s.
LAYERS_PER_CALL = 6
Caches = list[tuple[Array, Array]]


def layer_group(num_layers: int, most: int = LAYERS_PER_CALL) -> int:
    """Layers per compiled call: the largest divisor of ``num_layers`` up to ``most``, so that every call has the
    same shapes (one compilation serves them all)."""
    return max(g for g in range(1, min(most, num_layers) + 1) if num_layers % g == 0)


def _embed_step(top: Params, ids: Array, positions: Array, *, spec: ModelSpec) -> tuple[Array, Any]:
    _traces[0] += 1
    return embed(top, spec, ids, positions)


def _layer_step(
    p: Params,
    x: Array,
    rope: Any,
    cache: tuple[Array, Array],
    mirror: tuple[Array, Array] | None,
    batch: dict[str, Array],
    *,
    spec: ModelSpec,
    block_size: int,
    kind: str,
) -> tuple[Array, tuple[Array, Array], tuple[Array, Array] | None]:
    """One block of a step: writes its new K/V at the step's slots (and, decoding over the mirror, at the end
    of each mirror row), attends, and returns the residual stream, the layer's cache and mirror arrays."""
    new: dict[str, Any] = {"mirror": None}

    def attend(q: Array, k: Array, v: Array) -> Array:
        k_cache = write_kv(cache[0], batch["slots"], k)
        v_cache = write_kv(cache[1], batch["slots"], v)
        new["cache"] = (k_cache, v_cache)
        if kind == "decode":  # row i is sequence i
            tables, context = batch["tables"], batch["context_lens"]
            return decode_attention(q, k_cache, v_cache, tables, context, spec.scale, block_size)
        parts = []
        if mirror is not None:  # the first rows are the mirror's rows
            rows = batch["mirror_ctx"].shape[0]
            k_t, v_rows = append_rows(mirror[0], mirror[1], batch["positions"][:rows], k[:rows], v[:rows])
            new["mirror"] = (k_t, v_rows)
            parts.append(dense_decode_attention(q[:rows], k_t, v_rows, batch["mirror_ctx"], spec.scale))
            if kind == "mirror":
                return parts[0]
        elif batch["dec_rows"].shape[0]:
            qd, tables, context = q[batch["dec_rows"]], batch["dec_tables"], batch["dec_ctx"]
            parts.append(decode_attention(qd, k_cache, v_cache, tables, context, spec.scale, block_size))
        qp = q[batch["pre_rows"]]  # [Bp, Q, heads, d]
        tables, context, first = batch["pre_tables"], batch["pre_ctx"], batch["pre_start"]
        parts.append(prefill_attention(qp, k_cache, v_cache, tables, context, first, spec.scale, block_size))
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        return out[batch["out_rows"]]

    x = block(p, spec, x, rope, attend)
    return x, new["cache"], new["mirror"]


def _layers_step(
    ps: list[Params],
    x: Array,
    rope: Any,
    caches: Caches,
    mirrors: list[tuple[Array, Array] | None],
    batch: dict[str, Array],
    *,
    spec: ModelSpec,
    block_size: int,
    kind: str,
) -> tuple[Array, Caches, list[tuple[Array, Array] | None]]:
    """A group of consecutive blocks (:func:`_layer_step` each, in order); their caches and mirrors come back in
    the same order."""
    _traces[0] += 1
    new_caches, new_mirrors = [], []
    for p, cache, mirror in zip(ps, caches, mirrors, strict=True):
        x, cache, mirror = _layer_step(
            p, x, rope, cache, mirror, batch, spec=spec, block_size=block_size, kind=kind
        )
        new_caches.append(cache)
        new_mirrors.append(mirror)
    return x, new_caches, new_mirrors


def _head_step(top: Params, x: Array, rows: Array, *, spec: ModelSpec) -> Array:
    """Logits of ``rows`` of the residual stream."""
    _traces[0] += 1
    return compute_logits(top, spec, x[rows])


# ---- step inputs -----------------------------------------------------------------------------------------
@dataclass
class StepInputs:
    """One step's padded arrays, and how to read its logits back."""

    # "decode" (paged), "mirror" (decode over the mirror rows), "mixed" (chunks, decodes paged) or "mixed_mirror"
    kind: str
    # the arrays; "sample_rows" holds the rows whose logits the head computes: those of sampling_seqs in their
    # order, padded (the first len(sampling_seqs) logits rows are returned)
    batch: dict[str, np.ndarray]
    sampling_seqs: list[Sequence]
    num_tokens: int

    @property
    def shape_key(self) -> tuple[Any, ...]:
        return (self.kind, *sorted((k, v.shape) for k, v in self.batch.items()))


class StepBuilder:
    """Builds :class:`StepInputs` from a scheduler step (numpy, vectorised over tokens)."""

    def __init__(
        self, block_size: int, scratch_block: int, max_positions: int | None, single_row: bool = True
    ) -> None:
        self.block_size = block_size
        self.single_row = single_row  # a lone decode runs one row (see decode_rows)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.max_positions = max_positions  # learned position embeddings (GPT-2): the longest context
        self.min_width = bucket(-(-MIN_CONTEXT // block_size))

    def width(self, longest: int) -> int:
        """The bucketed block-table width for contexts of up to ``longest`` tokens."""
        self._check_positions(longest)
        return bucket(-(-longest // self.block_size), self.min_width)

    def mirror_width(self, longest: int) -> int:
        """The decode mirror's width in blocks for contexts of up to ``longest`` tokens: finer steps than the
        tables' (:func:`~app.engine.frameworks.buckets.context_bucket`), as a decode reads its whole width."""
        self._check_positions(longest)
        return context_bucket(-(-longest // self.block_size), self.min_width)

    def _check_positions(self, longest: int) -> None:
        if self.max_positions is not None and longest > self.max_positions:
            raise ValueError(
                f"position {longest - 1} beyond the model's {self.max_positions} learned positions"
            )

    def tables(self, seqs: list[Sequence], rows: int, width: int) -> np.ndarray:
        """Block tables ``[rows, width]``, padded with the scratch block."""
        out = np.full((rows, width), self.scratch_block, dtype=np.int32)
        for i, seq in enumerate(seqs):
            table = seq.block_table[:width]
            out[i, : len(table)] = table
        return out

    def decode(self, seqs: list[Sequence], starts: np.ndarray) -> StepInputs:
        """Every sequence one token at ``starts`` (its ``num_computed_tokens``), through the paged cache."""
        n, bs = len(seqs), self.block_size
        rows = decode_rows(n, self.single_row)
        tables = self.tables(seqs, rows, self.width(int(starts.max()) + 1))
        positions = _padded(starts, rows, 0)
        ids = _padded(np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), np.int64, n), rows, 0)
        slots = tables[np.arange(rows), positions // bs] * bs + positions % bs  # padding: the scratch block
        sampling = [i for i, s in enumerate(seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        batch = {"ids": ids, "positions": positions, "slots": slots.astype(np.int32), "tables": tables,
                 "context_lens": _padded(starts + 1, rows, 1),
                 "sample_rows": _padded(np.asarray(sampling, dtype=np.int64), rows, 0)}  # fmt: skip
        return StepInputs("decode", batch, [seqs[i] for i in sampling], n)

    def mirrored(self, seqs: list[Sequence], starts: np.ndarray, plan: MirrorPlan) -> StepInputs:
        """Every sequence one token, each in its mirror row (the other rows padding)."""
        bs, rows, at = self.block_size, plan.num_rows, plan.rows  # positions checked by mirror_width
        blocks = np.fromiter(
            (s.block_table[p // bs] for s, p in zip(seqs, starts, strict=True)), np.int64, len(seqs)
        )
        ids = np.zeros(rows, dtype=np.int32)
        ids[at] = [s.token_ids[s.num_computed_tokens] for s in seqs]
        positions = np.zeros(rows, dtype=np.int32)
        positions[at] = starts
        slots = np.full(rows, self.scratch_slot, dtype=np.int32)
        slots[at] = blocks * bs + starts % bs
        context = np.ones(rows, dtype=np.int32)  # padding rows see one key: finite, never used
        context[at] = starts + 1
        sampling = [i for i, s in enumerate(seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        batch = {"ids": ids, "positions": positions, "slots": slots, "mirror_ctx": context,
                 "sample_rows": _padded(at[sampling], rows, 0)}  # fmt: skip
        return StepInputs("mirror", batch, [seqs[i] for i in sampling], len(seqs))

    def mixed(self, seqs: list[Sequence], num_sched: dict[int, int], plan: MirrorPlan | None) -> StepInputs:
        """Prefill chunks, and any one-token sequences: those fill the first rows (each in its mirror row when
        ``plan`` places them, else in order), then the chunks' tokens follow; see :meth:`_decode_part` and
        :meth:`_prefill_part`."""
        bs = self.block_size
        dec = [s for s in seqs if num_sched[s.seq_id] == 1]
        pre = [s for s in seqs if num_sched[s.seq_id] > 1]
        dec_starts = np.fromiter((s.num_computed_tokens for s in dec), dtype=np.int64, count=len(dec))
        qlens = np.fromiter((num_sched[s.seq_id] for s in pre), dtype=np.int64, count=len(pre))
        starts = np.fromiter((s.num_computed_tokens for s in pre), dtype=np.int64, count=len(pre))
        segment = plan.num_rows if plan is not None else len(dec)  # the rows before the chunks
        dec_at = plan.rows if plan is not None else np.arange(len(dec))
        first_rows = segment + np.cumsum(qlens) - qlens
        num_tokens = int(qlens.sum())
        num_rows = bucket(segment + num_tokens, MIN_TOKENS)
        longest = max(int((starts + qlens).max()), int(dec_starts.max()) + 1 if dec else 0)
        tables = self.tables(dec + pre, len(dec) + len(pre), self.width(longest))
        ids = np.zeros(num_rows, dtype=np.int32)
        positions = np.zeros(num_rows, dtype=np.int32)
        slots = np.full(num_rows, self.scratch_slot, dtype=np.int32)
        ids[dec_at] = [s.token_ids[s.num_computed_tokens] for s in dec]
        positions[dec_at] = dec_starts
        slots[dec_at] = tables[np.arange(len(dec)), dec_starts // bs] * bs + dec_starts % bs
        owner = np.repeat(np.arange(len(pre)), qlens)
        chunk_pos = starts[owner] + np.arange(num_tokens) - (first_rows - segment)[owner]
        rows = slice(segment, segment + num_tokens)
        ids[rows] = [t for s, a, n in zip(pre, starts, qlens, strict=True) for t in s.token_ids[a : a + n]]
        positions[rows] = chunk_pos
        slots[rows] = tables[len(dec) + owner, chunk_pos // bs] * bs + chunk_pos % bs
        batch = {"ids": ids, "positions": positions, "slots": slots}
        if plan is not None:
            batch["mirror_ctx"] = np.ones(segment, dtype=np.int32)
            batch["mirror_ctx"][dec_at] = dec_starts + 1
            dec_outputs = segment
        else:
            dec_outputs = self._decode_part(batch, tables[: len(dec)], dec_starts)
        out_rows = self._prefill_part(batch, tables[len(dec) :], qlens, starts, first_rows, dec_outputs)
        out_rows[:segment] = np.arange(segment)  # the decode outputs come in row order
        batch["out_rows"] = out_rows
        row_of = {id(s): int(r) for s, r in zip(dec, dec_at, strict=True)}
        row_of.update({id(s): int(f + n - 1) for s, f, n in zip(pre, first_rows, qlens, strict=True)})
        sampling = [s for s in seqs if s.num_computed_tokens + num_sched[s.seq_id] == s.num_tokens]
        last_rows = np.asarray([row_of[id(s)] for s in sampling], dtype=np.int64)
        batch["sample_rows"] = _padded(last_rows, dec_outputs + len(batch["pre_ctx"]), 0)
        kind = "mixed" if plan is None else "mixed_mirror"
        return StepInputs(kind, batch, sampling, len(dec) + num_tokens)

    def _decode_part(self, batch: dict[str, np.ndarray], tables: np.ndarray, starts: np.ndarray) -> int:
        """The one-token sequences' rows, tables and context lengths (padded); returns their row bucket."""
        n = len(starts)
        rows = bucket(n, MIN_SEQS) if n else 0
        dec_tables = np.full((rows, tables.shape[1]), self.scratch_block, dtype=np.int32)
        dec_tables[:n] = tables
        batch["dec_rows"] = _padded(np.arange(n), rows, 0)
        batch["dec_tables"] = dec_tables
        batch["dec_ctx"] = _padded(starts + 1, rows, 1)
        return rows

    def _prefill_part(
        self,
        batch: dict[str, np.ndarray],
        tables: np.ndarray,
        qlens: np.ndarray,
        starts: np.ndarray,
        first_rows: np.ndarray,
        dec_rows: int,
    ) -> np.ndarray:
        """The chunks as ``[Bp, Q]`` query blocks (query ``i`` of chunk ``b`` is flat row ``first_rows[b] + i``,
        clipped for padding); returns where each flat chunk row's attention output is: the decode part's
        ``dec_rows`` rows come first, then the query blocks row by row."""
        n = len(qlens)
        rows = bucket(n)
        queries = bucket(int(qlens.max()), MIN_QUERIES)
        num_rows = len(batch["ids"])
        pre_rows = np.zeros((rows, queries), dtype=np.int32)
        pre_rows[:n] = np.minimum(first_rows[:, None] + np.arange(queries)[None, :], num_rows - 1)
        pre_tables = np.full((rows, tables.shape[1]), self.scratch_block, dtype=np.int32)
        pre_tables[:n] = tables
        batch["pre_rows"] = pre_rows
        batch["pre_tables"] = pre_tables
        batch["pre_ctx"] = _padded(starts + qlens, rows, 1)
        batch["pre_start"] = _padded(starts, rows, 0)
        owner = np.repeat(np.arange(n), qlens)
        within = np.arange(len(owner)) - (np.cumsum(qlens) - qlens)[owner]
        out_rows = np.zeros(num_rows, dtype=np.int32)  # padding rows: any output, never read
        out_rows[first_rows[0] : first_rows[0] + len(owner)] = dec_rows + owner * queries + within
        return out_rows


def _padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, dtype=np.int32)
    out[: len(values)] = values
    return out


# ---- the runner ------------------------------------------------------------------------------------------
class JaxRunner:
    """The engine's :class:`~app.engine.frameworks.FrameworkRunner` in JAX (float32, or bfloat16 products; CPU)."""

    framework = "jax"

    def __init__(
        self,
        model: PagedCausalLM,
        model_config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        mirror_bytes: int | None = None,
        bfloat16_products: bool = False,
    ) -> None:
        """``mirror_bytes``: the most the decode mirror may hold (:mod:`.mirror`); None: as much as the paged
        cache, 0: decode through the paged cache always. ``bfloat16_products``: the product weights in bfloat16
        (products of bfloat16 inputs with float32 sums); the residual stream, norms, attention, KV cache and logits
        stay float32."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        spec = self.spec = ModelSpec.from_config(model_config)
        self.params = params_from_torch(model, model_config, bfloat16_products)
        self.top = {k: v for k, v in self.params.items() if k != "layers"}  # all but the blocks' weights
        self.layers_per_call = layer_group(spec.num_layers)
        self.fast_compile = sum(x.size for x in jax.tree.leaves(self.params)) < FAST_COMPILE_PARAMS
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # one block past the block manager's range: the scratch block padding rows write and padded tables name
        num_slots = (num_blocks + 1) * block_size
        shape = (spec.num_kv_heads, num_slots, spec.head_dim)
        self.caches: Caches = [
            (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)) for _ in range(spec.num_layers)
        ]
        learned = spec.max_positions if spec.architecture == "gpt2" else None
        self.builder = StepBuilder(block_size, num_blocks, learned, single_row=not bfloat16_products)
        paged_bytes = 2 * spec.num_layers * num_slots * spec.num_kv_heads * spec.head_dim * 4
        keep_freed_buffers()  # the mirror's resizes reuse freed memory instead of page-faulting fresh mappings
        self.mirror = DecodeMirror(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            block_size,
            paged_bytes if mirror_bytes is None else mirror_bytes,
            self.fast_compile,
        )
        self.timings = RunnerTimings()
        self.captures = CaptureStore()  # hidden-state capture is the torch runner's: stays empty here
        self.num_compilations = 0
        self.step_shapes: set[tuple[Any, ...]] = set()  # the distinct padded shapes run so far

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's padded inputs: the one-token sequences over the mirror where it fits, else paged."""
        seqs = out.scheduled
        if not seqs:
            raise ValueError("nothing scheduled: the runner needs at least one sequence")
        for seq in out.preempted:
            self.mirror.forget(seq.seq_id)
        num_sched = out.num_scheduled_tokens
        dec = [s for s in seqs if num_sched[s.seq_id] == 1]
        plan = None
        if dec:
            starts = np.fromiter((s.num_computed_tokens for s in dec), dtype=np.int64, count=len(dec))
            traces = self.mirror.num_traces
            width = self.builder.mirror_width(int(starts.max()) + 1)
            rows = decode_rows(len(dec), self.builder.single_row)
            plan = self.mirror.plan(dec, starts, rows, width, self.caches)
            self.num_compilations += self.mirror.num_traces - traces
        if len(dec) < len(seqs):
            return self.builder.mixed(seqs, num_sched, plan)
        if plan is None:
            return self.builder.decode(seqs, starts)
        return self.builder.mirrored(seqs, starts, plan)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one scheduler step; returns the logits of the sequences that sample, and those sequences."""
        t0 = time.perf_counter()
        step = self.prepare(out)
        t1 = time.perf_counter()
        logits = self.run(step)
        t2 = time.perf_counter()
        tm = self.timings
        tm.prepare_s += t1 - t0
        tm.forward_s += t2 - t1
        tm.num_steps += 1
        tm.num_tokens += step.num_tokens
        return logits, step.sampling_seqs

    def run(self, step: StepInputs) -> torch.Tensor:
        """The step's sampling logits ``[len(step.sampling_seqs), vocab]`` (float32, CPU)."""
        before = _traces[0]
        fast, spec, kind = self.fast_compile, self.spec, step.kind
        embed_fn = jitted(_embed_step, fast, ("spec",), ())
        layers_fn = jitted(_layers_step, fast, ("spec", "block_size", "kind"), ("caches", "mirrors"))
        head_fn = jitted(_head_step, fast, ("spec",), ())
        batch = jax.device_put(step.batch)  # once: every layer reads the same arrays
        mirror = self.mirror.arrays if kind in ("mirror", "mixed_mirror") else None
        x, rope = embed_fn(self.top, batch["ids"], batch["positions"], spec=spec)
        layers = self.params["layers"]
        for first in range(0, len(layers), self.layers_per_call):
            group = range(first, first + self.layers_per_call)
            mirrors = [None if mirror is None else mirror[i] for i in group]
            x, caches, mirrors = layers_fn(
                [layers[i] for i in group], x, rope, [self.caches[i] for i in group], mirrors, batch,
                spec=spec, block_size=self.block_size, kind=kind,
            )  # fmt: skip
            for i, cache, m in zip(group, caches, mirrors, strict=True):
                self.caches[i] = cache
                if mirror is not None:
                    mirror[i] = m
        logits = head_fn(self.top, x, batch["sample_rows"], spec=spec)
        # the logits buffer itself, no copy (waits for the step): no jax array refers to it any more, so the torch
        # tensor owns it (a copy of the sampling rows cost ~1.2 ms a 64-row SmolLM2 step)
        out = torch.from_dlpack(logits.block_until_ready())
        self.num_compilations += _traces[0] - before
        self.step_shapes.add(step.shape_key)
        return out[: len(step.sampling_seqs)]

    def warmup(self) -> None:
        """Compile a one-sequence decode and the smallest prefill (every row padding: they write only the
        scratch block and a free mirror row), so a first short request does not wait for them."""
        # one sequence: a chat's first request
        rows, width, scratch = decode_rows(1, self.builder.single_row), self.builder.min_width, self.num_blocks
        if self.mirror.nbytes(rows, width) <= self.mirror.max_bytes:
            self.mirror.allocate(rows, width)
            zeros = np.zeros(rows, dtype=np.int32)
            decode = {"ids": zeros, "positions": zeros, "slots": np.full(rows, self.builder.scratch_slot, np.int32),
                      "mirror_ctx": np.ones(rows, dtype=np.int32), "sample_rows": zeros}  # fmt: skip
            self.run(StepInputs("mirror", decode, [], 0))
        tokens = np.zeros(MIN_TOKENS, dtype=np.int32)
        mixed = {
            "ids": tokens,
            "positions": tokens,
            "slots": np.full(MIN_TOKENS, self.builder.scratch_slot, dtype=np.int32),
            "dec_rows": np.zeros(0, dtype=np.int32),
            "dec_tables": np.zeros((0, width), dtype=np.int32),
            "dec_ctx": np.zeros(0, dtype=np.int32),
            "pre_rows": np.zeros((1, MIN_TOKENS), dtype=np.int32),
            "pre_tables": np.full((1, width), scratch, dtype=np.int32),
            "pre_ctx": np.ones(1, dtype=np.int32),
            "pre_start": np.zeros(1, dtype=np.int32),
            "out_rows": tokens,
            "sample_rows": np.zeros(1, dtype=np.int32),
        }
        self.run(StepInputs("mixed", mixed, [], 0))


def make_runner(
    model: PagedCausalLM,
    model_config: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    bfloat16_products: bool = False,
) -> JaxRunner:
    """The entry point :func:`app.engine.frameworks.build_runner` calls."""
    return JaxRunner(
        model,
        model_config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        bfloat16_products=bfloat16_products,
    )


# ---- layer by layer --------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("spec",))
def _layer_outputs(params: Params, ids: Array, *, spec: ModelSpec) -> dict[str, Array]:
    collect: list[Array] = []
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    x = forward(
        params, spec, ids, positions, lambda _, q, k, v: causal_attention(q, k, v, spec.scale), collect
    )
    normed = final_norm(params, spec, x)
    out = {"embeddings": collect[0]}
    out.update({f"block.{i}": h for i, h in enumerate(collect[1:])})
    out["final_norm"] = normed
    out["logits"] = normed @ params["head"]
    return out


def layer_outputs(
    model: PagedCausalLM, model_config: ModelConfig, token_ids: list[int]
) -> dict[str, np.ndarray]:
    """One sequence through the JAX model, no cache: float32 ``"embeddings"``, ``"block.{i}"`` (the residual
    stream after block ``i``), ``"final_norm"`` (``[T, hidden]``) and ``"logits"`` (``[T, vocab]``)."""
    if not token_ids:
        raise ValueError("layer_outputs needs at least one token")
    spec = ModelSpec.from_config(model_config)
    params = params_from_torch(model, model_config)
    outputs = _layer_outputs(params, jnp.asarray(token_ids, dtype=jnp.int32), spec=spec)
    return {name: np.array(value, dtype=np.float32) for name, value in outputs.items()}
