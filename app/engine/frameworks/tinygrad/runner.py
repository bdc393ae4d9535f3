"""The tinygrad model runner: a paged KV cache in tinygrad buffers, step inputs in bucketed shapes, TinyJit'ed step
functions per bucket.

One engine step (a :class:`~app.engine.core.scheduler.SchedulerOutput`: prefill chunks and decodes of several
sequences) becomes flat int32 inputs, exactly as :meth:`app.engine.model_runner.ModelRunner.prepare` lays them out:
token ids, positions, the cache slot of each new token, each row's block table, and the rows that sample. Their
shapes are padded to buckets (:mod:`app.engine.frameworks.buckets`: powers of two for ``T`` token rows and ``S``
sampling rows, 1.5x and 2x steps for ``W`` blocks per table, which the attention reads whole), so a
step replays the TinyJit captures of its bucket and a new batch size compiles nothing while its bucket is known.
Padding rows write their keys and values into a scratch block past the block manager's range and see only that
block; padded table entries point at it too and are masked; padded sampling rows repeat row 0 and are dropped.

A step is three TinyJit'ed functions (see :mod:`.models`): the embeddings (per ``T``), one decoder layer (per ``T``
and ``W``: its weights and its layer number are arguments, so a capture is replayed for every layer, which makes
capturing ~30x cheaper for SmolLM2 than capturing the whole model; two captures alternate, see :class:`_Table`), and
the head (per ``T`` and ``S``). A new table width thus captures the layer only, and a new sampling count the head.

A step with enough work is split by sequence between two threads (:class:`TinygradRunner`), each with its own
buckets and captures; ``num_compilations`` counts every capture.

Prefix caching needs nothing here: a sequence whose first blocks are cached starts at ``num_computed_tokens`` and
its rows read those blocks through its table like any other context (the block manager only shares blocks that are
full and computed, so no block is written by one thread while another reads it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context

from app.engine.config import ModelConfig
from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.frameworks.buckets import context_bucket
from app.engine.frameworks.buckets import pow2_bucket as bucket
from app.engine.frameworks.tinygrad import tuning
from app.engine.frameworks.tinygrad.layers import dims
from app.engine.frameworks.tinygrad.models import StepTensors, TinyCausalLM, build_model
from app.engine.hidden_states import CaptureStore
from app.engine.model_runner import RunnerTimings

tuning.configure()  # the CPU device, and our products' loads: see the tuning module

__all__ = ["MIN_KEYS", "SAMPLE_ALL_ROWS", "KVCache", "TinygradRunner", "bucket", "layer_outputs", "make_runner"]

#: tables cover at least this many key positions (rounded up to whole blocks and a power of two): contexts shorter
#: than that share one width bucket (fewer compilations) at the cost of attending over a few masked slots
MIN_KEYS = 128
#: steps of at most this many rows return the logits of every row (one head bucket per row bucket): decodes sample
#: every row anyway
SAMPLE_ALL_ROWS = 16
#: a step runs on several threads when its rows times a layer's weight bytes reach this: below it (few rows, or a
#: small model) a kernel takes less time than the Python launching it, and a second thread gains nothing
MIN_SPLIT_WORK = 64 << 20


def in_process() -> Context:
    """Compile in this process: tinygrad's worker processes would compile the product kernels without the load
    handling :func:`.tuning.configure` installs here (correct, but slower kernels)."""
    return Context(PARALLEL=0)


def _int32(array: np.ndarray) -> Tensor:
    """A tinygrad view of ``array``'s memory (written in place every step: no copy passes through tinygrad)."""
    return Tensor.from_blob(array.ctypes.data, array.shape, dtype=dtypes.int32, device="CPU")


class KVCache:
    """Float32 keys ``[layers, blocks, kv_heads, head_dim, block_size]`` and values ``[layers, blocks, kv_heads,
    block_size, head_dim]`` (see :mod:`.kernels`) of ``num_blocks + 1`` blocks: the last is the padding rows' scratch.

    The memory is one zeroed anonymous mapping (:func:`app.engine.attention.zeroed_mapping`), committed page by page
    as blocks are first written, that tinygrad uses in place (``Tensor.from_blob``)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int) -> None:
        from app.engine.attention import zeroed_mapping

        self.block_size = block_size
        self.scratch_block = num_blocks
        layers, blocks, kv_heads, head_dim = config.num_layers, num_blocks + 1, config.num_kv_heads, config.head_dim
        per_cache = layers * blocks * block_size * kv_heads * head_dim
        self._memory = zeroed_mapping((2, per_cache), torch.float32)
        base = self._memory.data_ptr()
        self.keys = Tensor.from_blob(
            base, (layers, blocks, kv_heads, head_dim, block_size), dtype=dtypes.float32, device="CPU"
        )
        self.values = Tensor.from_blob(
            base + per_cache * 4, (layers, blocks, kv_heads, block_size, head_dim), dtype=dtypes.float32, device="CPU"
        )
        self._layer_numbers = np.arange(layers, dtype=np.int32)
        self.layer_ids = [_int32(self._layer_numbers[i : i + 1]) for i in range(layers)]


class _Jit:
    """A TinyJit'ed function. Its first call captures (compiles) it; replays call the capture directly: the
    arguments are the same realized buffers, or buffers of the same shapes, every time, so TinyJit's per-call
    argument checks only cost time."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.jit = TinyJit(fn)
        # capture on the first call: an eager first run would schedule and compile the same kernels once more for
        # nothing (the weights and the cache are realized buffers already)
        self.jit.cnt = 1

    def __call__(self, *args: Tensor) -> Any:
        captured = self.jit.captured
        if captured is None:
            with in_process():
                return self.jit(*args)
        return captured([a.uop.base for a in args], {})


class _Rows:
    """The inputs of ``T`` rows (written in place every step) and the embeddings step of that size."""

    def __init__(self, rows: int, embed: _Jit) -> None:
        self.ids = np.zeros(rows, dtype=np.int32)
        self.positions = np.zeros(rows, dtype=np.int32)
        self.slots = np.zeros(rows, dtype=np.int32)
        self.tensors = [_int32(a) for a in (self.ids, self.positions, self.slots)]
        self.embed = embed


class _Table:
    """The block tables ``[T, W]`` and the layer step of that shape, captured twice: layers alternate between the
    two, so a layer's input is never the output buffer of its own capture (TinyJit would copy such an input first,
    through an uncached schedule: ~3 ms per layer)."""

    def __init__(self, rows: int, width: int, layers: tuple[_Jit, _Jit]) -> None:
        self.tables = np.zeros((rows, width), dtype=np.int32)
        self.tensor = _int32(self.tables)
        self.layers = layers


class _Head:
    """The sampling rows ``[S]`` and the head step for ``T`` rows."""

    def __init__(self, num_sample: int, head: _Jit) -> None:
        self.sample = np.zeros(num_sample, dtype=np.int32)
        self.tensor = _int32(self.sample)
        self.head = head
        self.output: Any = None  # the capture's logits buffer, rewritten by every replay


class _ShardStep:
    """One shard's part of a step: its buckets (inputs written), the number of sampling rows, the real rows."""

    def __init__(self, rows: _Rows, table: _Table, head: _Head, num_sample: int, tokens: int) -> None:
        self.rows, self.table, self.head = rows, table, head
        self.num_sample = num_sample
        self.tokens = tokens

    @property
    def captured(self) -> bool:
        jits = (self.rows.embed, *self.table.layers, self.head.head)
        return all(j.jit.captured is not None for j in jits)


class _Shard:
    """Buckets and TinyJit captures for the rows of one thread (see :class:`TinygradRunner`)."""

    def __init__(self, runner: TinygradRunner) -> None:
        self.runner = runner
        self._rows: dict[int, _Rows] = {}
        self._tables: dict[tuple[int, int], _Table] = {}
        self._heads: dict[tuple[int, int], _Head] = {}

    def _rows_bucket(self, rows: int) -> _Rows:
        found = self._rows.get(rows)
        if found is None:
            model = self.runner.model

            def embed(ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
                return tuple(t.contiguous().realize() for t in model.embed(ids, positions))

            found = self._rows[rows] = _Rows(rows, self.runner.jit(embed))
        return found

    def _table_bucket(self, rows: int, width: int) -> _Table:
        found = self._tables.get((rows, width))
        if found is None:
            model, cache = self.runner.model, self.runner.cache
            shared = len(model.shared_names)  # what embed() returns besides x

            def layer(x: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, layer: Tensor, *rest: Tensor) -> Tensor:
                step = StepTensors(positions, slots, tables, tuple(rest[:shared]))
                return model.layer(x, rest[shared:], step, cache, layer).contiguous().realize()

            pair = (self.runner.jit(layer), self.runner.jit(layer))
            found = self._tables[(rows, width)] = _Table(rows, width, pair)
        return found

    def _head_bucket(self, rows: int, num_sample: int) -> _Head:
        found = self._heads.get((rows, num_sample))
        if found is None:
            model = self.runner.model

            def head(x: Tensor, sample: Tensor) -> Tensor:
                return model.head(x, sample).realize()

            found = self._heads[(rows, num_sample)] = _Head(num_sample, self.runner.jit(head))
        return found

    def fill(self, seqs: list[Sequence], counts: np.ndarray, starts: np.ndarray) -> _ShardStep:
        """Write the inputs of ``seqs`` (``counts`` new tokens from ``starts``) into their buckets (see the module
        docstring)."""
        bs, scratch = self.runner.block_size, self.runner.cache.scratch_block
        ends = starts + counts
        total = int(counts.sum())
        rows = bucket(total)
        width = context_bucket(max(len(s.block_table) for s in seqs), self.runner.min_width)
        sample_rows = (counts.cumsum() - 1)[ends == np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))]
        num_sample = rows if rows <= SAMPLE_ALL_ROWS else bucket(len(sample_rows))
        r, tb, hd = self._rows_bucket(rows), self._table_bucket(rows, width), self._head_bucket(rows, num_sample)
        tables = np.full((len(seqs), width), scratch, dtype=np.int32)
        row = 0
        for i, seq in enumerate(seqs):
            n, start = int(counts[i]), int(starts[i])
            tables[i, : len(seq.block_table)] = seq.block_table
            r.ids[row : row + n] = seq.token_ids[start : start + n]
            row += n
        seq_of = np.repeat(np.arange(len(seqs)), counts)
        positions = np.arange(total) + np.repeat(ends - counts.cumsum(), counts)  # start + offset in the chunk
        r.ids[total:] = 0
        r.positions[:total] = positions
        r.positions[total:] = 0
        tb.tables[:total] = tables[seq_of]
        tb.tables[total:] = scratch
        r.slots[:total] = tb.tables[np.arange(total), positions // bs] * bs + positions % bs
        r.slots[total:] = scratch * bs
        hd.sample[: len(sample_rows)] = sample_rows
        hd.sample[len(sample_rows) :] = 0
        return _ShardStep(r, tb, hd, len(sample_rows), total)

    def padding_step(self) -> _ShardStep:
        """One row of padding, the smallest table width (warmup): it writes into and reads the scratch block."""
        scratch, bs = self.runner.cache.scratch_block, self.runner.block_size
        r, tb, hd = self._rows_bucket(1), self._table_bucket(1, self.runner.min_width), self._head_bucket(1, 1)
        r.ids[:], r.positions[:], r.slots[:], tb.tables[:], hd.sample[:] = 0, 0, scratch * bs, scratch, 0
        return _ShardStep(r, tb, hd, 0, 0)

    def run(self, step: _ShardStep) -> np.ndarray:
        """The step: embeddings, every layer (two captures alternating, replayed with each layer's weights), head;
        the logits of its sampling rows (a copy: the buffer is the next step's too)."""
        r, tb, hd = step.rows, step.table, step.head
        ids, positions, slots = r.tensors
        x, *shared = r.embed(ids, positions)
        cache = self.runner.cache
        for i, (layer_id, weights) in enumerate(zip(cache.layer_ids, self.runner.weights, strict=True)):
            x = tb.layers[i % 2](x, positions, slots, tb.tensor, layer_id, *shared, *weights)
        out = hd.head(x, hd.tensor)
        if hd.output is None:
            hd.output = out.uop.buffer
        logits: np.ndarray = hd.output.numpy().reshape(out.shape)
        return logits[: step.num_sample]


class TinygradRunner:
    """The engine's :class:`~app.engine.frameworks.FrameworkRunner` for tinygrad (float32, CPU).

    tinygrad runs a kernel on the thread that launches it (ctypes releases the GIL meanwhile), so a step of several
    sequences is split between ``threads`` shards, by sequence (a sequence's rows must see the keys and values its
    earlier rows write in the same step), each replaying its own captures on its own thread. Captures (scheduling
    and compiling) happen on the engine's thread, one at a time."""

    framework = "tinygrad"

    def __init__(
        self, model: TinyCausalLM, config: ModelConfig, *, num_blocks: int, block_size: int, threads: int = 1
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.model = model
        self.config = config
        self.block_size = block_size
        self.cache = KVCache(config, num_blocks, block_size)
        # tables of at least this many blocks (MIN_KEYS positions): short contexts share one width bucket
        self.min_width = bucket(-(-MIN_KEYS // block_size))
        self.timings = RunnerTimings()
        self.captures = CaptureStore()  # hidden-state captures are a torch-framework feature: stays empty
        # TinyJit captures: per shard, four for a new row count (embeddings, two layers, head), two for a new width,
        # one for a new sampling count
        self.num_compilations = 0
        self.num_split_steps = 0  # steps run on more than one thread
        self.weights = [model.layer_weights(i) for i in range(config.num_layers)]
        self._layer_bytes = sum(int(np.prod(dims(t))) * 4 for t in self.weights[0])
        self.shards = [_Shard(self) for _ in range(max(1, threads))]
        self._pool = ThreadPoolExecutor(len(self.shards) - 1) if len(self.shards) > 1 else None

    def jit(self, fn: Callable[..., Any]) -> _Jit:
        self.num_compilations += 1  # captured (compiled) by its first call
        return _Jit(fn)

    def _split(self, counts: np.ndarray) -> list[int]:
        """Where the scheduled sequences are cut between shards: about equal rows each, whole sequences only; one
        shard for small steps (see :data:`MIN_SPLIT_WORK`)."""
        total, n = int(counts.sum()), len(self.shards)
        if n == 1 or len(counts) < n or total * self._layer_bytes < MIN_SPLIT_WORK:
            return [len(counts)]
        cum = counts.cumsum()
        cuts = [int(np.searchsorted(cum, total * (i + 1) / n)) + 1 for i in range(n - 1)]
        cuts = [min(max(c, i + 1), len(counts) - (n - 1 - i)) for i, c in enumerate(cuts)]
        return [*cuts, len(counts)]

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one scheduler step: the logits ``[n, vocab]`` (float32, CPU) of the ``n`` sequences that sample, in
        the order of ``out.scheduled``."""
        t0 = time.perf_counter()
        seqs = out.scheduled
        if not seqs:
            raise ValueError("nothing scheduled: the runner needs at least one sequence")
        counts = np.fromiter((out.num_scheduled_tokens[s.seq_id] for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        steps, lo = [], 0
        for shard, hi in zip(self.shards, self._split(counts), strict=False):
            steps.append(shard.fill(seqs[lo:hi], counts[lo:hi], starts[lo:hi]))
            lo = hi
        self.num_split_steps += int(len(steps) > 1)
        t1 = time.perf_counter()
        parts = self._run(steps)
        logits = torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))
        t2 = time.perf_counter()
        tm = self.timings
        tm.prepare_s += t1 - t0
        tm.forward_s += t2 - t1
        tm.num_steps += 1
        tm.num_tokens += int(counts.sum())
        sampling = [s for s in seqs if s.num_computed_tokens + out.num_scheduled_tokens[s.seq_id] == s.num_tokens]
        return logits, sampling

    def _run(self, steps: list[_ShardStep]) -> list[np.ndarray]:
        """Each shard's step, on its own thread once every capture exists (captures run one after the other)."""
        if self._pool is None or len(steps) == 1 or not all(s.captured for s in steps):
            return [shard.run(step) for shard, step in zip(self.shards, steps, strict=False)]
        futures = [self._pool.submit(shard.run, step) for shard, step in zip(self.shards[1:], steps[1:], strict=False)]
        first = self.shards[0].run(steps[0])
        return [first, *(f.result() for f in futures)]

    def warmup(self) -> None:
        """Compile the single-sequence decode bucket (one row, the smallest table width) of the first shard."""
        shard = self.shards[0]
        shard.run(shard.padding_step())


def make_runner(
    model: torch.nn.Module,
    model_config: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> TinygradRunner:
    """The engine's entry point (see :func:`app.engine.frameworks.build_runner`): copies the float32 weights of
    ``model`` into tinygrad and allocates the KV cache. ``max_num_seqs`` and ``max_num_batched_tokens`` bound the
    buckets a step can reach; nothing is sized by them up front."""
    del max_num_seqs, max_num_batched_tokens
    tiny = build_model(model, model_config, max_positions=max_model_len)
    threads = min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return TinygradRunner(tiny, model_config, num_blocks=num_blocks, block_size=block_size, threads=threads)


def layer_outputs(model: torch.nn.Module, model_config: ModelConfig, token_ids: list[int]) -> dict[str, np.ndarray]:
    """A single-sequence forward of ``token_ids`` (no JIT): float32 arrays ``embeddings``, ``block.0`` ...
    ``block.{L-1}`` (the residual stream after each block), ``final_norm`` (each ``[T, hidden]``) and ``logits``
    (``[T, vocab]``), to compare with Hugging Face layer by layer."""
    if not token_ids:
        raise ValueError("layer_outputs needs at least one token")
    n = len(token_ids)
    block_size = 16
    blocks = -(-n // block_size)
    tiny = build_model(model, model_config, max_positions=n)
    cache = KVCache(model_config, blocks, block_size)
    positions = np.arange(n, dtype=np.int32)

    def tensor(a: np.ndarray) -> Tensor:
        return Tensor(np.ascontiguousarray(a, dtype=np.int32), dtype=dtypes.int32, device="CPU")

    # blocks 0.. in order, so slot == position; every row samples
    tables = np.tile(np.arange(blocks, dtype=np.int32), (n, 1))
    step = StepTensors(tensor(positions), tensor(positions), tensor(tables))
    collect: dict[str, Tensor] = {}
    logits = tiny.forward(tensor(np.asarray(token_ids)), step, tensor(positions), cache, cache.layer_ids, collect)
    with in_process():
        Tensor.realize(logits, *collect.values())
    result = {name: t.numpy().astype(np.float32) for name, t in collect.items()}
    result["logits"] = logits.numpy().astype(np.float32)
    return result
