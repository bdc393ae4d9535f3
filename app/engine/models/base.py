"""What every engine model offers the model runner: a paged forward, logits, weight loading, a KV binding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from app.engine.attention import AttentionMetadata, AttentionWorkspace
from app.engine.config import ModelConfig
from app.engine.kernels.elementwise import argmax_ties
from app.engine.kernels.matmul import bf16_gemm, bf16_matmul_supported, bf16_small_matmul, w8a8_linear
from app.engine.kernels.qblock import QBlockWeight, qblock_linear, qblock_reference
from app.engine.models.layers import Int8Weight, Linear, linear


def refine_tied_maxima(logits: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor) -> None:
    """Recompute in float32, in place, each row's largest logits where several are equal.

    oneDNN's bfloat16 product gives its output in bfloat16, so every logit is rounded to 8 bits. Rounding keeps the
    order of two values but can make them equal, and greedy decoding then took the first of the tie, not the
    larger. For example, SmolLM2 in bfloat16 began "What is the capital of France?" with "L" over "The". The tied
    entries get their float32 dot products (from the same bfloat16 inputs), so argmax picks the true largest;
    every other logit keeps its value. Each row is refined alone, so batching does not change it."""
    found = argmax_ties(logits)
    if found is None:
        top = logits.max(dim=-1, keepdim=True).values
        tied = (logits == top).sum(dim=1) > 1
    else:
        top, tied = logits.gather(1, found[0][:, None]), found[1] > 1
    if not bool(tied.any()):
        return
    rows = tied.nonzero().flatten()
    sub = logits.index_select(0, rows)
    where, cols = (sub == top.index_select(0, rows)).nonzero(as_tuple=True)
    exact = (hidden.index_select(0, rows[where]).bfloat16().float() * head.index_select(0, cols).float()).sum(-1)
    logits[rows[where], cols] = exact


class PagedCausalLM(nn.Module):
    """Base of our causal LMs. Subclasses define ``forward`` and ``load_hf_state_dict``."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        # Where the weights will live once loaded (parameters are meta placeholders until then).
        self.param_dtype = dtype
        self.param_device = torch.device(device)
        self.compute_dtype = compute_dtype_for(dtype, self.param_device)
        self.kv_caches: list[torch.Tensor] = []
        self.attn_workspace = AttentionWorkspace()
        # quantization="gguf": the LM head in the file's own blocks (qblock kernel), beside the float copy the
        # embedding lookup reads
        self.lm_head_blocks: QBlockWeight | None = None
        # quantization "auto" without bfloat16 products: the LM head's int8 copy for the logits of more rows than
        # the blocks serve (see Int8Weight), like the Linears'
        self.lm_head_int8: Int8Weight | None = None
        # quantization "auto": GGUF blocks beside the float weights serve steps of at most this many rows (None:
        # the blocks, where there are any, serve every step)
        self.block_rows: int | None = None
        # what a model builds from its weights and caches for fast decode steps (llama: the C decode layers);
        # None until first used, and again whenever the weights or the caches change
        self.decode_plan: Any = None

    def blocks_serve(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs on the GGUF blocks (where the model has them)."""
        return self.block_rows is None or rows <= self.block_rows

    def weights_changed(self) -> None:
        """Forget what was built from the weights (call after changing them in place, as quantization does):
        the C decode layers, and int8 copies (their layers run in float32 again)."""
        self.decode_plan = None
        self.lm_head_int8 = None
        for module in self.modules():
            if isinstance(module, Linear):
                module.int8 = None

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Attach per-layer caches ``[2, num_blocks, block_size, kv_heads, head_dim]`` (see allocate_kv_cache)."""
        cfg = self.config
        if len(kv_caches) != cfg.num_layers:
            raise ValueError(f"need {cfg.num_layers} per-layer KV caches, got {len(kv_caches)}")
        for i, cache in enumerate(kv_caches):
            if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != (cfg.num_kv_heads, cfg.head_dim):
                raise ValueError(
                    f"KV cache {i} has shape {tuple(cache.shape)}, expected "
                    f"[2, num_blocks, block_size, {cfg.num_kv_heads}, {cfg.head_dim}]"
                )
        self.kv_caches = list(kv_caches)
        self.decode_plan = None

    def _check_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> None:
        if not self.kv_caches:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(allocate_kv_cache(...)) first")
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be flat and equal length, got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if input_ids.shape[0] != attn.num_tokens:
            raise ValueError(
                f"batch has {input_ids.shape[0]} tokens but metadata describes {attn.num_tokens}"
            )
        # This model's gather scratch (a draft and a target model may share one metadata object).
        attn.workspace = self.attn_workspace

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define forward(input_ids, positions, attn)")

    def lm_head_weight(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define lm_head_weight()")

    def lm_head_source(self) -> str:
        """The checkpoint (HF) name of the tensor :meth:`lm_head_weight` holds: ``lm_head.weight``, or the
        embedding's when the head is tied to it."""
        raise NotImplementedError(f"{type(self).__name__} must define lm_head_source()")

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` for final hidden states ``[B, hidden]`` (select the last positions first).

        ``out`` lets a runner reuse one logits buffer across steps (a fresh [B, vocab] tensor every step costs
        page faults on CPU); the caller must be done with the previous step's logits.
        """
        if self.lm_head_blocks is not None and hidden.dtype == torch.float32 and self.blocks_serve(hidden.shape[0]):
            logits = qblock_linear(hidden, self.lm_head_blocks)
            return qblock_reference(hidden, self.lm_head_blocks) if logits is None else logits
        int8 = self.lm_head_int8
        if int8 is not None and hidden.dtype == torch.float32 and hidden.dim() == 2:
            if int8.outliers is not None:
                return w8a8_linear(hidden, int8.qweight_t, int8.scales, None, int8.outliers, int8.keep)
            int8.observe(hidden)  # the calibration pass
        head = self.lm_head_weight()
        cpu = hidden.device.type == "cpu"
        if head.dtype == torch.bfloat16 and hidden.dtype == torch.float32 and cpu and bf16_matmul_supported():
            # our kernels' float32 sums, not rounded to bfloat16 (so no ties to refine either)
            rows = hidden.to(torch.bfloat16)
            exact = bf16_small_matmul(rows, head, out_f32=True)
            if exact is None:
                exact = bf16_gemm(rows, head, out_f32=True)
            if exact is not None:
                return exact
        if out is None or head.dtype != hidden.dtype:
            logits = linear(hidden, head)
            if head.dtype == torch.bfloat16 and hidden.dtype == torch.float32 and logits.device.type == "cpu":
                refine_tied_maxima(logits, hidden, head)
            return logits
        return torch.mm(hidden, head.t(), out=out)

    def linear_sources(self) -> dict[str, list[str]]:
        """For each Linear (by module name), the HF weights it holds, stacked along the output rows in this
        order (fused projections); quantizers that bring their own blocks use it. Empty: none known."""
        return {}

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load weights named and laid out as the Hugging Face checkpoint of this architecture."""
        raise NotImplementedError(f"{type(self).__name__} must define load_hf_state_dict(state)")

    def _column_major_names(self) -> set[str]:
        """The 2-D weights used as the right operand of ``x @ W.T``: every Linear weight and the LM head.

        On CPU they are stored column-major (``W.T`` contiguous). ``F.linear`` then hands MKL a plain
        ``[in, out]`` matrix, whose matrix-vector product streams the weights about 1.3x (layers) to 2x (the
        49k-row head) faster than the transposed row-major product; decoding one sequence reads every weight
        once per token, so this is most of its time. Larger batches run at the same speed either way.
        """
        head = self.lm_head_weight()
        names = {name for name, p in self.named_parameters() if p is head}
        for prefix, module in self.named_modules():
            if isinstance(module, Linear):
                names.add(f"{prefix}.weight" if prefix else "weight")
        return names

    def _assign(self, ours: dict[str, torch.Tensor]) -> None:
        """Materialise every parameter from a complete state dict of our own names.

        All weights of one dtype go into ONE allocation (each view 64-byte aligned): first-touching one big
        block is far cheaper than hundreds of separate allocations, and the copy casts to the target dtype and
        device. The matrix-product weights take ``param_dtype``, the rest (norms, biases, position embeddings)
        ``compute_dtype``: they differ only for bfloat16 on CPU (see :func:`compute_dtype_for`).
        """
        self.weights_changed()
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(ours))
        unexpected = sorted(set(ours) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        products = self._column_major_names()
        column_major = products if self.param_device.type == "cpu" else set()
        groups: dict[torch.dtype, list[str]] = {}
        for name in params:
            groups.setdefault(self.param_dtype if name in products else self.compute_dtype, []).append(name)
        with torch.no_grad():
            for dtype, names in groups.items():
                # bfloat16 weights stay row-major: oneDNN packs its own copy and bf16_matmul.c reads [out, in]
                layout = set() if dtype == torch.bfloat16 else column_major
                self._assign_group(ours, {n: params[n] for n in names}, dtype, layout)

    def _assign_group(
        self,
        ours: dict[str, torch.Tensor],
        params: dict[str, nn.Parameter],
        dtype: torch.dtype,
        column_major: set[str],
    ) -> None:
        align = max(1, 64 // torch.empty((), dtype=dtype).element_size())
        sizes = {name: -(-p.numel() // align) * align for name, p in params.items()}
        arena = torch.empty(sum(sizes.values()), dtype=dtype, device=self.param_device)
        offset = 0
        for name, p in params.items():
            src = ours[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(p.shape)}")
            flat = arena[offset : offset + p.numel()]
            if name in column_major:
                # Same [out, in] shape and values, stored transposed: see _column_major_names.
                view = flat.view(p.shape[1], p.shape[0]).t()
            else:
                view = flat.view(p.shape)
            view.copy_(src)
            offset += sizes[name]
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            module._parameters[leaf] = nn.Parameter(view, requires_grad=False)


def compute_dtype_for(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of activations, norms, attention and the KV cache for weights in ``dtype``.

    bfloat16 on CPU computes its matrix products in bfloat16 (oneDNN on AVX512-BF16: half the weight bytes
    and twice the FLOPs of float32) and everything else in float32, converting at each product: the norms,
    rotary embedding, attention and SwiGLU kernels are our float32 C kernels, and keeping the residual stream
    in float32 is more accurate than Transformers' all-bfloat16 forward. Elsewhere, one dtype throughout.
    """
    return torch.float32 if dtype == torch.bfloat16 and device.type == "cpu" else dtype


def take(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``state[name]`` with a clear error naming what the checkpoint lacks."""
    try:
        return state[name]
    except KeyError:
        raise ValueError(f"checkpoint lacks tensor {name!r}") from None
