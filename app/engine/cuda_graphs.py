"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is a few hundred tiny kernels, and launching them from Python costs
more than running them. So a decode-only step is laid out in fixed-shape buffers (the batch padded up to a
capture size, the context up to a width bucket) and the whole forward plus LM head is captured once per
(batch size, width) as a CUDA graph; later steps copy their inputs into the buffers and replay it.

Padding rows write their K/V into a scratch block past the block manager's range (``sink_block``) and attend
to that one slot, so they never touch a real sequence's cache. Graphs are captured on first use of a shape
and share one memory pool. Without CUDA (or with ``use_graphs=False``) the same padded forward runs eagerly,
which keeps its numbers checkable on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from app.engine.attention import AttentionMetadata, StaticDecode
from app.engine.models.base import PagedCausalLM

__all__ = ["DecodeGraphRunner", "batch_buckets", "width_buckets"]


def batch_buckets(max_batch: int) -> list[int]:
    """Capture sizes: powers of two up to ``max_batch``, and ``max_batch`` itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def width_buckets(max_blocks: int) -> list[int]:
    """Context widths in blocks: powers of two up to ``max_blocks``, and ``max_blocks`` itself."""
    return batch_buckets(max_blocks)


def _bucket(sizes: list[int], need: int) -> int:
    return next(s for s in sizes if s >= need)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's output buffer [batch, vocab]


class DecodeGraphRunner:
    """Runs decode-only steps of ``model`` from fixed-shape buffers, replaying CUDA graphs where it can."""

    def __init__(
        self,
        model: PagedCausalLM,
        *,
        block_size: int,
        max_batch: int,
        max_blocks: int,
        sink_block: int,
        use_graphs: bool,
    ) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"max_batch and max_blocks must be >= 1, got {max_batch} and {max_blocks}")
        self.model = model
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.sink_block = sink_block
        self.use_graphs = use_graphs
        self.batch_sizes = batch_buckets(max_batch)
        self.widths = width_buckets(max_blocks)
        device = model.param_device

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.input_ids = longs(max_batch)
        self.positions = longs(max_batch)
        self.slot_mapping = longs(max_batch)
        self.context_lens = longs(max_batch) + 1
        self.block_tables = longs(max_batch, max_blocks)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None
        self.replays = 0  # steps served from this runner (counted for tests and logs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether the step of ``meta`` is a decode-only one within the captured shapes."""
        return (
            meta.is_decode_only
            and meta.num_seqs <= self.max_batch
            and -(-meta.max_context_len // self.block_size) <= self.max_blocks
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of a step that :meth:`fits`: one row per sequence, or the rows ``sample_index`` picks."""
        n = meta.num_seqs
        size = _bucket(self.batch_sizes, n)
        width = _bucket(self.widths, -(-meta.max_context_len // self.block_size))
        entry = self._graphs.get((size, width))
        if entry is None and self.use_graphs:
            entry = self._graphs[(size, width)] = self._capture(size, width)
        self._load_inputs(input_ids, positions, meta, size, width)  # after a capture: it pads every row
        if entry is not None:
            entry.graph.replay()
            logits = entry.logits
        else:
            logits = self._forward(self._metadata(size, width), size)
        self.replays += 1
        out = logits[:n]
        return out if sample_index is None else out.index_select(0, sample_index)

    # ---- buffers ----
    def _load_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int, width: int
    ) -> None:
        n = meta.num_seqs
        have = min(meta.block_tables.shape[1], width)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        ctx = torch.tensor(meta.context_lens, dtype=torch.long)
        self.context_lens[:n].copy_(ctx, non_blocking=True)
        tables = self.block_tables[:size, :width]
        tables.fill_(self.sink_block)
        tables[:n, :have].copy_(meta.block_tables[:, :have], non_blocking=True)
        if n < size:
            self._pad_rows(n, size)

    def _pad_rows(self, start: int, stop: int) -> None:
        """Rows past the real batch: token 0 at position 0, writing to and reading one scratch slot."""
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(self.sink_block * self.block_size)
        self.context_lens[start:stop].fill_(1)

    # ---- the forward ----
    def _metadata(self, size: int, width: int) -> AttentionMetadata:
        """The step's metadata over the buffers; built outside any capture (it copies lists to the device)."""
        bs = self.block_size
        meta = AttentionMetadata(
            query_lens=[1] * size,
            context_lens=[width * bs] * size,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size, :width],
            block_size=bs,
        )
        meta.static_decode = StaticDecode(
            self.block_tables[:size, :width], self.context_lens[:size], width * bs
        )
        return meta

    def _forward(self, meta: AttentionMetadata, size: int) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model(self.input_ids[:size], self.positions[:size], meta)
            return self.model.compute_logits(hidden)

    def _capture(self, size: int, width: int) -> _Graph:
        """Capture the padded forward of this shape (after one eager run, which settles lazy allocations)."""
        self._pad_rows(0, size)  # the capture's own runs write only to the scratch slot
        self.block_tables[:size, :width].fill_(self.sink_block)
        meta = self._metadata(size, width)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(meta, size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(meta, size)
        self._pool = graph.pool()
        return _Graph(graph, logits)
