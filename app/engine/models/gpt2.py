"""GPT-2 (learned positions, LayerNorm, GELU-new, fused c_attn) on the paged KV cache.

HF stores GPT-2 projections as ``Conv1D`` with weights ``[in, out]``; we transpose them once at load so every
projection is an ordinary ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.attention import AttentionMetadata, paged_attention
from app.engine.config import ModelConfig
from app.engine.models.base import PagedCausalLM, take
from app.engine.models.layers import Embedding, LayerNorm, Linear, placeholder

# Old GPT-2 checkpoints carry the causal-mask buffers `attn.bias` / `attn.masked_bias`: not weights.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.embed = config.num_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.c_attn = Linear(config.hidden_size, 3 * self.embed)
        self.c_proj = Linear(self.embed, config.hidden_size)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).split(self.embed, dim=-1)
        shape = (t, self.num_heads, self.head_dim)
        out = paged_attention(q.view(shape), k.view(shape), v.view(shape), kv_cache, attn, self.scale)
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size)
        # gelu_new and gelu_pytorch_tanh are both the tanh approximation; plain "gelu" is exact erf.
        self.approximate = "none" if config.activation == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, attn)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(PagedCausalLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture != "gpt2":
            raise ValueError(f"GPT2LMHeadModel needs a gpt2 config, got {config.architecture!r}")
        super().__init__(config, dtype, device)
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = placeholder(config.vocab_size, config.hidden_size)

    def lm_head_weight(self) -> torch.Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head

    def lm_head_source(self) -> str:
        return "transformer.wte.weight" if self.lm_head is None else "lm_head.weight"

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` for a flat batch; writes the new K/V into the bound cache."""
        self._check_inputs(input_ids, positions, attn)
        # From the metadata, not positions.max(): no device sync, and a CUDA graph's fixed-shape step (whose
        # runner admits only contexts within max_model_len) is skipped, as its context_lens are placeholders.
        last = attn.max_context_len - 1
        if attn.static_decode is None and last >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {last} beyond GPT-2's {self.config.max_position_embeddings} learned positions"
            )
        x = self.wte(input_ids).to(self.compute_dtype) + self.wpe(positions)
        for block, cache in zip(self.h, self.kv_caches, strict=True):
            x = block(x, cache, attn)
        return self.ln_f(x)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load HF GPT-2 weights (``transformer.`` prefix optional; Conv1D weights transposed here)."""
        src = {k.removeprefix("transformer."): v for k, v in state.items() if not k.endswith(_MASK_BUFFERS)}
        ours: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        for name in dict(self.named_parameters()):
            hf_name = "lm_head.weight" if name == "lm_head" else name
            tensor = take(src, hf_name)
            used.add(hf_name)
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            ours[name] = tensor
        used.add("lm_head.weight")  # tied checkpoints may carry a copy of wte
        unexpected = sorted(set(src) - used)
        if unexpected:
            raise ValueError(f"checkpoint has tensors this GPT-2 config does not use: {unexpected[:8]}")
        self._assign(ours)
