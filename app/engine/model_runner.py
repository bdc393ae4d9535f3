"""The model runner: owns the model and its paged KV cache, turns a scheduler step into one forward pass.

Per step it flattens every scheduled sequence's new tokens into one batch (prefill chunks and decodes
together), builds the attention metadata, runs the model and returns the logits of the sequences that
sample in this step. This is the hot path of the engine: index tensors are computed with a handful of
vectorised torch ops whatever the batch size, and Python touches each sequence once, never each token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import app.engine.kernels.library as library
from app.engine.attention import AttentionMetadata, allocate_kv_cache
from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.cuda_graphs import DecodeGraphRunner
from app.engine.hidden_states import CaptureStore, build_step_hooks
from app.engine.kernels.attention import bf16_attention_supported
from app.engine.kernels.matmul import bf16_matmul_supported
from app.engine.models.base import PagedCausalLM
from app.engine.models.layers import Linear

__all__ = ["ModelRunner", "RunnerTimings", "StepBatch"]


@dataclass
class RunnerTimings:
    """Cumulative seconds spent building inputs vs running the model (to keep the overhead visible)."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    num_steps: int = 0
    num_tokens: int = 0


@dataclass
class StepBatch:
    """The flat model inputs of one step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_index: torch.Tensor | None  # rows of the hidden states to sample from; None = every row
    sampling_seqs: list[Sequence]  # the sequences those rows belong to, in order


class ModelRunner:
    def __init__(
        self,
        model: PagedCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        cuda_graphs: bool = False,
        max_graph_batch: int = 256,
        max_model_len: int = 2048,
    ) -> None:
        """``cuda_graphs``: replay decode-only steps of up to ``max_graph_batch`` sequences and
        ``max_model_len`` tokens from CUDA graphs (on a CUDA device; ignored elsewhere)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        graphs = cuda_graphs and self.device.type == "cuda"
        # Graphs pad their batch with rows that write into one scratch block past the block manager's range.
        self.kv_caches = allocate_kv_cache(
            model.config, num_blocks + int(graphs), block_size, dtype=dtype, device=self.device
        )
        model.bind_kv_cache(self.kv_caches)
        self.graphs: DecodeGraphRunner | None = None
        if graphs:
            self.graphs = DecodeGraphRunner(
                model,
                block_size=block_size,
                max_batch=max_graph_batch,
                max_blocks=-(-max_model_len // block_size),
                sink_block=num_blocks,
                use_graphs=True,
            )
        self.timings = RunnerTimings()
        # A bfloat16 model (quantized ones included) on a CPU with AVX512-BF16: attention in bfloat16 values too.
        self.bf16_products = (
            self.device.type == "cpu"
            and model.lm_head_weight().dtype == torch.bfloat16
            and bf16_attention_supported()
        )
        # bfloat16 or int8 products run on OpenMP at every size: keep the C kernels on the same threads
        self.openmp_only = _products_use_openmp(model)
        self.captures = CaptureStore()  # hidden states captured for requests that asked, until they finish

    # ---- inputs ----
    def prepare(self, out: SchedulerOutput) -> StepBatch:
        """Flat inputs for the scheduled sequences: each contributes the tokens from its computed
        prefix up to ``num_scheduled_tokens`` more, and samples if that reaches its last token."""
        seqs = out.scheduled
        if not seqs:
            raise ValueError("nothing scheduled: the runner needs at least one sequence")
        num_sched = out.num_scheduled_tokens
        input_ids: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        total = 0
        spans: list[tuple[int, int, int]] = []  # each sequence's first row, first position and rows
        for seq in seqs:
            n = num_sched[seq.seq_id]
            spans.append((total, seq.num_computed_tokens, n))
            start = seq.num_computed_tokens
            end = start + n
            if n == 1:
                input_ids.append(seq.token_ids[start])
            else:
                input_ids.extend(seq.token_ids[start:end])
            starts.append(start)
            query_lens.append(n)
            context_lens.append(end)
            tables.append(seq.block_table)
            total += n
            if end == seq.num_tokens:  # this chunk reaches the last token: its logits give the next one
                sample_rows.append(total - 1)
                sampling_seqs.append(seq)

        num_seqs = len(seqs)
        width = max(len(t) for t in tables)
        # Padding points at block 0; attention masks everything past a sequence's context.
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        start_t = torch.tensor(starts, dtype=torch.long)
        bs = self.block_size
        if total == num_seqs:  # decode-only (or one-token chunks): one token per sequence
            positions = start_t
            block_of = block_tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1)
        else:
            qlen_t = torch.tensor(query_lens, dtype=torch.long)
            seq_of = torch.repeat_interleave(torch.arange(num_seqs), qlen_t)  # [T] owning sequence
            first_row = torch.cumsum(qlen_t, 0) - qlen_t  # flat row of each sequence's first token
            positions = torch.arange(total) - (first_row - start_t)[seq_of]
            block_of = block_tables[seq_of, positions // bs]
        slot_mapping = block_of * bs + positions % bs
        ids_t = torch.tensor(input_ids, dtype=torch.long)

        sample_index: torch.Tensor | None = None
        if len(sample_rows) != total:  # some rows are mid-prompt chunk tokens: pick the sampling ones
            sample_index = torch.tensor(sample_rows, dtype=torch.long)
        if self.device.type != "cpu":
            ids_t, positions, slot_mapping, block_tables = (
                t.to(self.device, non_blocking=True) for t in (ids_t, positions, slot_mapping, block_tables)
            )
            if sample_index is not None:
                sample_index = sample_index.to(self.device, non_blocking=True)
        attn = AttentionMetadata(
            query_lens=query_lens,
            context_lens=context_lens,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            block_size=bs,
            bf16_products=self.bf16_products,
        )
        if any(s.sampling_params.capture is not None or s.sampling_params.interventions for s in seqs):
            attn.hooks = build_step_hooks(seqs, spans, len(self.kv_caches), self.device)
        return StepBatch(ids_t, positions, attn, sample_index, sampling_seqs)

    # ---- forward ----
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits ``[len(batch.sampling_seqs), vocab]`` (empty when no sequence samples this step)."""
        model = self.model
        if not model.kv_caches or model.kv_caches[0] is not self.kv_caches[0]:
            model.bind_kv_cache(self.kv_caches)  # another runner (engine) shares this model
        hooks = batch.attn.hooks
        if hooks is None and self.graphs is not None and self.graphs.fits(batch.attn):
            return self.graphs.run(batch.input_ids, batch.positions, batch.attn, batch.sample_index)
        with torch.inference_mode(), library.openmp_only(self.openmp_only):
            hidden = model(batch.input_ids, batch.positions, batch.attn)
            if hooks is not None:
                self.captures.add(hooks)
            if batch.sample_index is not None:
                hidden = hidden.index_select(0, batch.sample_index)
            return model.compute_logits(hidden)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one scheduler step; returns the logits of the sequences that sample, and those sequences."""
        t0 = time.perf_counter()
        batch = self.prepare(out)
        t1 = time.perf_counter()
        logits = self.run(batch)
        t2 = time.perf_counter()
        tm = self.timings
        tm.prepare_s += t1 - t0
        tm.forward_s += t2 - t1
        tm.num_steps += 1
        tm.num_tokens += batch.attn.num_tokens
        return logits, batch.sampling_seqs

    def warmup(self, num_tokens: int = 16) -> None:
        """One small prefill and one decode, so the first request does not pay one-off allocation and
        kernel-selection costs. Writes only into block 0, which is free and uncached at start-up."""
        bs = self.block_size
        if bs < 2:  # the decode below must fit in block 0 with the prefill
            return
        n = min(num_tokens, bs - 1)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = AttentionMetadata.build([n], [n], [[0]], bs, device=self.device)
        self.run(StepBatch(ids, pos, meta, None, []))
        meta = AttentionMetadata.build([1], [n + 1], [[0]], bs, device=self.device)
        self.run(StepBatch(ids[:1], pos[:1] + n, meta, None, []))


def _products_use_openmp(model: PagedCausalLM) -> bool:
    """Whether a few-token step's products run on OpenMP (oneDNN, torch's int8/int4 kernels): bfloat16 weights
    without AVX512-BF16, or torch-quantized ones. Float32 ones (small_matmul), bfloat16 ones with AVX512-BF16
    (bf16_matmul) and GGUF blocks (qblock) run on the kernels' pool."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if model.lm_head_blocks is not None and all(m.qweight is not None for m in linears):
        return False
    if bf16_matmul_supported() and all(
        m.weight.dtype == torch.bfloat16 and m.scales is None and m.qweight is None for m in linears
    ):
        return False  # bfloat16 weights: a few-token step's products run in bf16_matmul.c, on the pool
    return model.lm_head_weight().dtype != torch.float32 or any(m.scales is not None for m in linears)
