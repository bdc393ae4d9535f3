"""Llama family (GQA, RoPE with theta/scaling, RMSNorm, SwiGLU, optional tied head) on the paged KV cache.

Projections are fused (q|k|v and gate|up) so a step does two big matmuls instead of five small ones; the
loader concatenates the separate HF tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

import app.engine.kernels.matmul as matmul
from app.engine.attention import AttentionMetadata, paged_attention
from app.engine.config import ModelConfig
from app.engine.kernels.decode_layer import (
    DecodeLayer,
    DecodeStepBuffers,
    LayerWeights,
    bf16_values_supported,
    decode_layer_enabled,
)
from app.engine.kernels.matmul import MAX_ROWS, ONEDNN_MIN_ROWS
from app.engine.models.base import PagedCausalLM, take
from app.engine.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    apply_rope_,
    bf16_io,
    bf16_swiglu_mlp,
    placeholder,
    rope_cos_sin,
    silu_mul,
)

# Checkpoint entries that are buffers, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_weights(lin: Linear, blocks: bool = True) -> LayerWeights | None:
    """A Linear's weights as the C decode layer takes them: GGUF blocks, float32 or bfloat16 (no int8/int4).
    ``blocks=False``: the float weights of a Linear that keeps both (None when it has only blocks)."""
    if lin.qweight is not None and blocks:
        return LayerWeights(lin.weight, lin.qweight, lin.bias)
    if lin.qweight is not None and lin.block_rows is None:
        return None
    if lin.scales is not None or lin.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return LayerWeights(lin.weight, None, lin.bias)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.layer_index = 0  # set by the model: which block this is (for per-request hooks)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        keep_bf16: bool = False,
    ) -> torch.Tensor:
        t = x.shape[0]
        # A bfloat16 model on CPU: q, k and v stay in bfloat16 (the attention kernels read them so, and round
        # its output for o_proj), or float32 where its attention does not compute in bfloat16 values.
        qkv = self.qkv_proj.forward(x, keep_bf16 and attn.bf16_products)
        qk_size = self.q_size + self.kv_size
        # Rotate q and k in one pass, in place: they are adjacent in the fused projection.
        qk = apply_rope_(
            qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, attn, self.scale)
        if attn.hooks is not None:  # a request zeroes some of this block's heads in its own rows
            out = attn.hooks.attention_output(self.layer_index, out, self.num_heads, self.head_dim)
        return self.o_proj.forward(out, keep_bf16)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, keep_bf16: bool = False) -> torch.Tensor:
        fused = bf16_swiglu_mlp(x, self.gate_up_proj, self.down_proj, keep_bf16)
        return self.down_proj(silu_mul(self.gate_up_proj(x))) if fused is None else fused


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous block's output (the embeddings, with ``residual`` None, for the first);
        returns this block's MLP output and the residual stream, which the next norm adds together.

        Submodules are called through ``forward``: ``nn.Module.__call__`` costs microseconds per call, and a
        one-token decode step makes hundreds of them. With bfloat16 weights on CPU the rows between the norms
        and the products travel in bfloat16 (the products take and give it; each conversion is a pass), the
        residual stream stays float32, and the numbers are those of converting at every product."""
        o_proj = self.self_attn.o_proj  # (rows for GGUF blocks kept beside it stay float32, as the kernel reads)
        io = torch.bfloat16 if bf16_io(o_proj) and not o_proj.blocks_serve(x.shape[0]) else None
        h, residual = self.input_layernorm.add_forward(x, residual, io)
        h = self.self_attn.forward(h, cos, sin, kv_cache, attn, io is not None)
        h, residual = self.post_attention_layernorm.add_forward(h, residual, io)
        return self.mlp.forward(h, io is not None), residual


class LlamaForCausalLM(PagedCausalLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture != "llama":
            raise ValueError(f"LlamaForCausalLM needs a llama config, got {config.architecture!r}")
        super().__init__(config, dtype, device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        for index, layer in enumerate(self.layers):
            cast(LlamaDecoderLayer, layer).self_attn.layer_index = index
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = placeholder(config.vocab_size, config.hidden_size)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", config.rope_inv_freq().to(self.param_device), persistent=False)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def lm_head_source(self) -> str:
        return "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` for a flat batch; writes the new K/V into the bound cache."""
        self._check_inputs(input_ids, positions, attn)
        x = self.embed_tokens(input_ids).to(self.compute_dtype)  # bfloat16 on CPU: see compute_dtype_for
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)  # shared by all layers
        in_c = self._decode_in_c(x, cos, sin, attn)
        if in_c is not None:
            return self.norm.add_forward(*in_c)[0]
        residual: torch.Tensor | None = None
        hooks = attn.hooks
        for index, (layer, cache) in enumerate(zip(self.layers, self.kv_caches, strict=True)):
            x, residual = layer.forward(x, residual, cos, sin, cache, attn)
            if hooks is not None:
                hooks.after_block(index, x, residual)
        hidden = self.norm.add_forward(x, residual)[0]
        if hooks is not None:
            hooks.after_norm(hidden)
        return hidden

    def _decode_in_c(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-only step with float32 or GGUF-block weights (a few tokens) or bfloat16 weights (any number)
        on CPU: each layer is one C call running the layer's kernels (kernels/decode_layer.py), the same numbers
        without ~10 Python wrappers per layer. Returns the last layer's output and the residual; None where it
        does not apply."""
        dec = attn.decode_index
        if dec is None or attn.prefills or attn.static_decode is not None or attn.hooks is not None:
            return None
        if x.dtype != torch.float32 or x.device.type != "cpu" or not decode_layer_enabled():
            return None
        blocks = self.blocks_serve(x.shape[0])
        if self.decode_plan is None:
            self.decode_plan = {}
        if blocks not in self.decode_plan:
            self.decode_plan[blocks] = self._build_decode_layers(blocks)
        layers, all_blocks = self.decode_plan[blocks]
        if not layers:
            return None
        # the products the Python layer would run: small_matmul below ONEDNN_MIN_ROWS, blocks up to MAX_ROWS,
        # bf16_gemm at any row count past BF16_MAX_ROWS (bf16_matmul up to it, which the C layer does not run)
        bf16_rows = layers[0].bf16_rows
        if bf16_rows and x.shape[0] <= matmul.BF16_MAX_ROWS:  # read now: the module's setting is the switch
            return None
        if not bf16_rows and x.shape[0] > (MAX_ROWS if all_blocks else ONEDNN_MIN_ROWS - 1):
            return None
        if bf16_rows and not attn.bf16_products:
            return None  # the Python layer would give its attention float32 rows
        if attn.bf16_products and not bf16_values_supported(layers[0]):
            return None
        if attn.slot_mapping.dtype != torch.int64 or dec.block_tables.dtype != torch.int64:
            return None
        step = DecodeStepBuffers(
            layers[0],
            cos=cos,
            sin=sin,
            slots=attn.slot_mapping,
            tables=dec.block_tables,
            context_lens=dec.context_lens,
            rows=dec.rows,
            max_context=dec.max_context_len,
            bf16_values=attn.bf16_products,
        )
        return step.run(layers, x.contiguous())

    def _build_decode_layers(self, blocks: bool = True) -> tuple[list[DecodeLayer], bool]:
        """Each layer's C struct (on the GGUF blocks where there are any and ``blocks``), or an empty list when one
        of them cannot run in C."""
        if self.param_device.type != "cpu" or len(self.kv_caches) != len(self.layers):
            return [], False
        built: list[DecodeLayer] = []
        for module, cache in zip(self.layers, self.kv_caches, strict=True):
            layer = cast(LlamaDecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [_layer_weights(lin, blocks) for lin in linears]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(w is None for w in weights) or norms[0].eps != norms[1].eps:
                return [], False
            one = DecodeLayer.build(
                norms=(norms[0].weight, norms[1].weight),
                eps=norms[0].eps,
                projections=(weights[0], weights[1], weights[2], weights[3]),  # type: ignore[arg-type]
                kv_cache=cache,
                heads=attn.num_heads,
                head_dim=attn.head_dim,
                scale=attn.scale,
            )
            if one is None:
                return [], False
            built.append(one)
        return built, all(one.all_qblock for one in built)

    def linear_sources(self) -> dict[str, list[str]]:
        sources: dict[str, list[str]] = {}
        for i in range(self.config.num_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            sources[ours + "self_attn.qkv_proj"] = [hf + f"self_attn.{n}_proj.weight" for n in "qkv"]
            sources[ours + "self_attn.o_proj"] = [hf + "self_attn.o_proj.weight"]
            sources[ours + "mlp.gate_up_proj"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
            sources[ours + "mlp.down_proj"] = [hf + "mlp.down_proj.weight"]
        return sources

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load HF ``LlamaForCausalLM`` weights (names with or without the ``model.`` prefix)."""
        src = {k.removeprefix("model."): v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            used.add(name)
            return take(src, name)

        ours: dict[str, torch.Tensor] = {
            "embed_tokens.weight": get("embed_tokens.weight"),
            "norm.weight": get("norm.weight"),
        }
        if self.lm_head is not None:
            ours["lm_head"] = get("lm_head.weight")
        else:
            used.add("lm_head.weight")  # a tied checkpoint may still carry a copy; the embedding wins
        bias = self.config.attention_bias
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            ours[p + "input_layernorm.weight"] = get(p + "input_layernorm.weight")
            ours[p + "post_attention_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
            ours[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0
            )
            ours[p + "self_attn.o_proj.weight"] = get(p + "self_attn.o_proj.weight")
            if bias:
                ours[p + "self_attn.qkv_proj.bias"] = torch.cat(
                    [get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0
                )
                ours[p + "self_attn.o_proj.bias"] = get(p + "self_attn.o_proj.bias")
            ours[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0
            )
            ours[p + "mlp.down_proj.weight"] = get(p + "mlp.down_proj.weight")
            if self.config.mlp_bias:
                ours[p + "mlp.gate_up_proj.bias"] = torch.cat(
                    [get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")], dim=0
                )
                ours[p + "mlp.down_proj.bias"] = get(p + "mlp.down_proj.bias")
        unexpected = sorted(set(src) - used)
        if unexpected:
            raise ValueError(f"checkpoint has tensors this Llama config does not use: {unexpected[:8]}")
        self._assign(ours)
