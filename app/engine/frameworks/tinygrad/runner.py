"""The tinygrad model runner: a paged KV cache in tinygrad buffers, step inputs in bucketed shapes, one TinyJit'ed
step function per bucket.

One engine step (a :class:`~app.engine.core.scheduler.SchedulerOutput`: prefill chunks and decodes of several
sequences) becomes flat int32 inputs, exactly as :meth:`app.engine.model_runner.ModelRunner.prepare` lays them out:
token ids, positions, the cache slot of each new token, each row's block table, and the rows that sample. Their
shapes are padded to buckets (powers of two: ``T`` token rows, ``W`` blocks per table, ``S`` sampling rows), so a
step reuses the TinyJit capture of its bucket and a new batch size does not compile anything while its bucket is
known. Padding rows write their keys and values into a scratch block past the block manager's range and see only
that block; padded table entries point at it too and are masked; padded sampling rows repeat row 0 and are dropped.

Prefix caching needs nothing here: a sequence whose first blocks are cached starts at ``num_computed_tokens`` and
its rows read those blocks through its table like any other context.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from app.engine.config import ModelConfig
from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.frameworks.tinygrad import tuning
from app.engine.hidden_states import CaptureStore
from app.engine.model_runner import RunnerTimings

tuning.configure()  # before tinygrad is imported: see the tuning module

from tinygrad import Tensor, TinyJit, dtypes  # noqa: E402

from app.engine.frameworks.tinygrad.models import StepTensors, TinyCausalLM, build_model  # noqa: E402

__all__ = ["MIN_KEYS", "KVCache", "TinygradRunner", "bucket", "layer_outputs", "make_runner"]


#: tables cover at least this many key positions (rounded up to whole blocks and a power of two): contexts shorter
#: than that share one width bucket (fewer compilations) at the cost of attending over a few masked slots
MIN_KEYS = 128


def bucket(n: int) -> int:
    """The padded size of ``n`` (>= 1): the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class KVCache:
    """Per layer, float32 keys ``[blocks, kv_heads, head_dim, block_size]`` and values ``[blocks, block_size,
    kv_heads, head_dim]`` (see :mod:`.kernels`), ``num_blocks + 1`` blocks: the last is the padding rows' scratch.

    The memory is one zeroed anonymous mapping (:func:`app.engine.attention.zeroed_mapping`), committed page by page
    as blocks are first written, that tinygrad uses in place (``Tensor.from_blob``)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int) -> None:
        from app.engine.attention import zeroed_mapping

        self.block_size = block_size
        self.scratch_block = num_blocks
        blocks, kv_heads, head_dim = num_blocks + 1, config.num_kv_heads, config.head_dim
        per_layer = blocks * block_size * kv_heads * head_dim
        self._memory = zeroed_mapping((config.num_layers, 2, per_layer), torch.float32)
        base = self._memory.data_ptr()

        def view(index: int, shape: tuple[int, ...]) -> Tensor:
            return Tensor.from_blob(base + index * per_layer * 4, shape, dtype=dtypes.float32, device="CPU")

        key_shape, value_shape = (blocks, kv_heads, head_dim, block_size), (blocks, block_size, kv_heads, head_dim)
        self.keys = [view(2 * layer, key_shape) for layer in range(config.num_layers)]
        self.values = [view(2 * layer + 1, value_shape) for layer in range(config.num_layers)]


class _Bucket:
    """One step shape ``(T, W, S)``: its int32 input arrays, written in place every step, the tinygrad Tensors over
    that same memory (so a step passes no data through tinygrad), and its TinyJit."""

    def __init__(self, key: tuple[int, int, int], step_fn: Any) -> None:
        rows, width, num_sample = key
        self.key = key
        self.ids = np.zeros(rows, dtype=np.int32)
        self.positions = np.zeros(rows, dtype=np.int32)
        self.slots = np.zeros(rows, dtype=np.int32)
        self.tables = np.zeros((rows, width), dtype=np.int32)
        self.sample = np.zeros(num_sample, dtype=np.int32)
        arrays = (self.ids, self.positions, self.slots, self.tables, self.sample)
        self.inputs = [
            Tensor.from_blob(a.ctypes.data, a.shape, dtype=dtypes.int32, device="CPU") for a in arrays
        ]
        self.jit = TinyJit(step_fn)
        # capture on the first call: an eager first run would schedule and compile the same kernels once more for
        # nothing (the weights and the cache are realized buffers already)
        self.jit.cnt = 1
        self.output: Any = None  # the JIT's logits buffer, reused by every replay

    def run(self) -> np.ndarray:
        """Run the step; the logits of all ``S`` sampling rows (a copy: the buffer is the next step's too)."""
        out = self.jit(*self.inputs)
        if self.output is None:
            self.output = out.uop.buffer
        return self.output.numpy().reshape(out.shape)


class TinygradRunner:
    """The engine's :class:`~app.engine.frameworks.FrameworkRunner` for tinygrad (float32, CPU)."""

    framework = "tinygrad"

    def __init__(
        self, model: TinyCausalLM, config: ModelConfig, *, num_blocks: int, block_size: int, max_model_len: int
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
        self.num_compilations = 0
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}

    # ---- inputs ----
    def _bucket(self, key: tuple[int, int, int]) -> _Bucket:
        found = self._buckets.get(key)
        if found is None:
            model, cache = self.model, self.cache

            def step_fn(ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, sample: Tensor) -> Tensor:
                return model.forward(StepTensors(ids, positions, slots, tables, sample), cache).realize()

            found = self._buckets[key] = _Bucket(key, step_fn)
            self.num_compilations += 1  # captured (compiled) by its first run
        return found

    def prepare(self, out: SchedulerOutput) -> tuple[_Bucket, int, list[Sequence], int]:
        """Write the step's inputs into its bucket (see the module docstring); returns the bucket, the number of
        sampling rows, the sequences that sample and the number of real token rows."""
        seqs = out.scheduled
        if not seqs:
            raise ValueError("nothing scheduled: the runner needs at least one sequence")
        bs, scratch = self.block_size, self.cache.scratch_block
        counts = np.fromiter((out.num_scheduled_tokens[s.seq_id] for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        ends = starts + counts
        sampling = [s for s, end in zip(seqs, ends.tolist(), strict=True) if end == s.num_tokens]
        total = int(counts.sum())
        width = max(self.min_width, bucket(max(len(s.block_table) for s in seqs)))
        b = self._bucket((bucket(total), width, bucket(len(sampling))))
        tables = np.full((len(seqs), width), scratch, dtype=np.int32)
        sample_rows = []
        row = 0
        for i, seq in enumerate(seqs):
            n, start = int(counts[i]), int(starts[i])
            tables[i, : len(seq.block_table)] = seq.block_table
            b.ids[row : row + n] = seq.token_ids[start : start + n]
            row += n
            if start + n == seq.num_tokens:  # the chunk reaches the last token: its logits give the next one
                sample_rows.append(row - 1)
        seq_of = np.repeat(np.arange(len(seqs)), counts)
        positions = np.arange(total) + np.repeat(ends - counts.cumsum(), counts)  # start + offset in the chunk
        b.ids[total:] = 0
        b.positions[:total] = positions
        b.positions[total:] = 0
        b.tables[:total] = tables[seq_of]
        b.tables[total:] = scratch
        b.slots[:total] = b.tables[np.arange(total), positions // bs] * bs + positions % bs
        b.slots[total:] = scratch * bs
        b.sample[: len(sample_rows)] = sample_rows
        b.sample[len(sample_rows) :] = 0
        return b, len(sample_rows), sampling, total

    # ---- forward ----
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one scheduler step: the logits ``[n, vocab]`` (float32, CPU) of the ``n`` sequences that sample."""
        t0 = time.perf_counter()
        b, num_sample, seqs, tokens = self.prepare(out)
        t1 = time.perf_counter()
        logits = torch.from_numpy(b.run()[:num_sample])
        t2 = time.perf_counter()
        tm = self.timings
        tm.prepare_s += t1 - t0
        tm.forward_s += t2 - t1
        tm.num_steps += 1
        tm.num_tokens += tokens
        return logits, seqs

    def warmup(self) -> None:
        """Compile the single-sequence decode bucket (one row, the smallest table width, one sampling row); its rows
        are padding: they write into and read the scratch block only."""
        b = self._bucket((1, self.min_width, 1))
        scratch = self.cache.scratch_block
        b.ids[:], b.positions[:], b.slots[:], b.tables[:], b.sample[:] = 0, 0, scratch * self.block_size, scratch, 0
        b.run()


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
    return TinygradRunner(
        tiny, model_config, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len
    )


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
    arrays = (
        np.asarray(token_ids, dtype=np.int32),
        positions,
        positions.copy(),  # blocks 0.. in order: slot == position
        np.tile(np.arange(blocks, dtype=np.int32), (n, 1)),
        positions.copy(),  # every row samples
    )
    step = StepTensors(*(Tensor(a, dtype=dtypes.int32, device="CPU") for a in arrays))
    collect: dict[str, Tensor] = {}
    logits = tiny.forward(step, cache, collect)
    Tensor.realize(logits, *collect.values())
    result = {name: t.numpy().astype(np.float32) for name, t in collect.items()}
    result["logits"] = logits.numpy().astype(np.float32)
    return result
