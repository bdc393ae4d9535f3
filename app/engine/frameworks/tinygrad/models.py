"""The Llama family and GPT-2 on tinygrad Tensors, over weights converted from the loaded PyTorch model.

Weights come from :meth:`torch.nn.Module.named_parameters` of :class:`app.engine.models.llama.LlamaForCausalLM` or
:class:`app.engine.models.gpt2.GPT2LMHeadModel` (fused ``qkv_proj``/``gate_up_proj`` and GPT-2's ``c_attn`` are
already ``[out, in]``), so whatever the engine loads (GGUF, HF folders) runs here too. One :meth:`forward` runs a
flat step (see :mod:`.layers`) and returns the logits of the sampling rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinygrad import Tensor

from app.engine.config import ModelConfig
from app.engine.frameworks.tinygrad.layers import (
    Linear,
    gather_rows,
    gelu,
    layer_norm,
    paged_attention,
    rms_norm,
    rope,
    swiglu,
    write_kv,
)

__all__ = ["GPT2Model", "LlamaModel", "StepTensors", "TinyCausalLM", "build_model"]


@dataclass
class StepTensors:
    """The inputs of one step (int32): ``T`` token rows, ``W`` blocks per row's table, ``S`` sampling rows."""

    ids: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] cache slot of each new token (padding rows: the scratch block)
    block_tables: Tensor  # [T, W] the block table of each row's sequence
    sample_rows: Tensor  # [S] rows whose logits are returned

    def as_args(self) -> tuple[Tensor, ...]:
        return self.ids, self.positions, self.slots, self.block_tables, self.sample_rows


def _tensor(array: np.ndarray) -> Tensor:
    return Tensor(np.ascontiguousarray(array, dtype=np.float32))


class TinyCausalLM:
    """Shared by both architectures: weights by name, the LM head, the forward skeleton."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray]) -> None:
        self.config = config
        self._params = params
        self._built: list[Tensor] = []  # realized together once the model is built (one schedule, not hundreds)
        self.scale = config.head_dim**-0.5
        self.lm_head = self._keep(Linear(params[self._head_name()]))

    def _head_name(self) -> str:
        raise NotImplementedError

    def take(self, name: str) -> Tensor:
        t = _tensor(self._params[name])
        self._built.append(t)
        return t

    def _keep(self, linear: Linear) -> Linear:
        self._built.extend(linear.tensors())
        return linear

    def linear(self, prefix: str) -> Linear:
        return self._keep(Linear(self._params[prefix + ".weight"], self._params.get(prefix + ".bias")))

    def finish(self, *extra: Tensor) -> None:
        """Realize every weight (and ``extra`` tables) in one go and drop the NumPy copies."""
        Tensor.realize(*self._built, *extra)
        self._built, self._params = [], {}

    def embed(self, step: StepTensors) -> Tensor:
        raise NotImplementedError

    def rotary(self, step: StepTensors) -> tuple[Tensor, Tensor] | None:
        """The step's RoPE ``(cos, sin)`` rows, shared by every layer (None: no rotary embedding)."""
        return None

    def block(self, index: int, x: Tensor, attend: Any, rotary: Any) -> Tensor:
        raise NotImplementedError

    def final_norm(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, step: StepTensors, caches: Any, collect: dict[str, Tensor] | None = None) -> Tensor:
        """Logits ``[S, vocab]`` of ``step.sample_rows``; writes the step's keys and values into ``caches`` (a
        :class:`~app.engine.frameworks.tinygrad.runner.KVCache`). ``collect`` receives the residual stream after
        the embeddings and each block, and the final norm's output."""
        def attend(index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k_cache, v_cache = write_kv(caches.keys[index], caches.values[index], k, v, step.slots)
            return paged_attention(q, k_cache, v_cache, step.block_tables, step.positions, self.scale)

        x, rotary = self.embed(step), self.rotary(step)
        if collect is not None:
            collect["embeddings"] = x
        for index in range(self.config.num_layers):
            x = self.block(index, x, attend, rotary).contiguous()
            if collect is not None:
                collect[f"block.{index}"] = x
        hidden = self.final_norm(x)
        if collect is not None:
            collect["final_norm"] = hidden
        return self.lm_head(gather_rows(hidden, step.sample_rows))


class LlamaModel(TinyCausalLM):
    """Llama: RMSNorm, RoPE (theta and scaling through ``ModelConfig.rope_inv_freq``), GQA/MQA, SwiGLU, optional
    biases and tied head."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], max_positions: int) -> None:
        super().__init__(config, params)
        self.embed_tokens = self.take("embed_tokens.weight")
        self.layers = [self._layer(f"layers.{i}.") for i in range(config.num_layers)]
        self.norm = self.take("norm.weight")
        # cos/sin of every position, computed as the torch model does (app.engine.models.layers.rope_cos_sin), so
        # the rotation uses the same float32 values; a step gathers its rows by position
        freqs = torch.arange(max_positions).float()[:, None] * config.rope_inv_freq()[None, :]
        self.cos, self.sin = _tensor(freqs.cos().numpy()), _tensor(freqs.sin().numpy())
        self.finish(self.cos, self.sin)

    def _head_name(self) -> str:
        return "embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head"

    def _layer(self, p: str) -> dict[str, Any]:
        return {
            "input_norm": self.take(p + "input_layernorm.weight"),
            "qkv": self.linear(p + "self_attn.qkv_proj"),
            "o": self.linear(p + "self_attn.o_proj"),
            "post_norm": self.take(p + "post_attention_layernorm.weight"),
            "gate_up": self.linear(p + "mlp.gate_up_proj"),
            "down": self.linear(p + "mlp.down_proj"),
        }

    def embed(self, step: StepTensors) -> Tensor:
        return gather_rows(self.embed_tokens, step.ids)

    def rotary(self, step: StepTensors) -> tuple[Tensor, Tensor]:
        return gather_rows(self.cos, step.positions), gather_rows(self.sin, step.positions)

    def block(self, index: int, x: Tensor, attend: Any, rotary: Any) -> Tensor:
        cfg, layer = self.config, self.layers[index]
        rows, hd = x.shape[0], cfg.head_dim
        q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        cos, sin = rotary
        qkv = layer["qkv"](rms_norm(x, layer["input_norm"], cfg.rms_norm_eps))
        q = rope(qkv[:, :q_size].reshape(rows, cfg.num_heads, hd), cos, sin)
        k = rope(qkv[:, q_size : q_size + kv_size].reshape(rows, cfg.num_kv_heads, hd), cos, sin)
        v = qkv[:, q_size + kv_size :]
        h = x + layer["o"](attend(index, q, k.reshape(rows, kv_size), v))
        mid = swiglu(layer["gate_up"](rms_norm(h, layer["post_norm"], cfg.rms_norm_eps)), cfg.intermediate_size)
        return h + layer["down"](mid)

    def final_norm(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.norm, self.config.rms_norm_eps)


class GPT2Model(TinyCausalLM):
    """GPT-2: learned positions, LayerNorm, GELU, fused ``c_attn``, biases everywhere."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], max_positions: int) -> None:
        super().__init__(config, params)
        self.wte = self.take("wte.weight")
        self.wpe = self.take("wpe.weight")
        self.blocks = [self._block(f"h.{i}.") for i in range(config.num_layers)]
        self.ln_f = (self.take("ln_f.weight"), self.take("ln_f.bias"))
        self.finish()

    def _head_name(self) -> str:
        return "wte.weight" if self.config.tie_word_embeddings else "lm_head"

    def _block(self, p: str) -> dict[str, Any]:
        return {
            "ln_1": (self.take(p + "ln_1.weight"), self.take(p + "ln_1.bias")),
            "c_attn": self.linear(p + "attn.c_attn"),
            "attn_proj": self.linear(p + "attn.c_proj"),
            "ln_2": (self.take(p + "ln_2.weight"), self.take(p + "ln_2.bias")),
            "c_fc": self.linear(p + "mlp.c_fc"),
            "mlp_proj": self.linear(p + "mlp.c_proj"),
        }

    def embed(self, step: StepTensors) -> Tensor:
        return gather_rows(self.wte, step.ids) + gather_rows(self.wpe, step.positions)

    def block(self, index: int, x: Tensor, attend: Any, rotary: Any) -> Tensor:
        cfg, blk = self.config, self.blocks[index]
        rows, embed = x.shape[0], cfg.num_heads * cfg.head_dim
        eps = cfg.layer_norm_eps
        (w1, b1), (w2, b2) = blk["ln_1"], blk["ln_2"]
        qkv = blk["c_attn"](layer_norm(x, w1, b1, eps))
        q = qkv[:, :embed].reshape(rows, cfg.num_heads, cfg.head_dim)
        h = x + blk["attn_proj"](attend(index, q, qkv[:, embed : 2 * embed], qkv[:, 2 * embed :]))
        return h + blk["mlp_proj"](gelu(blk["c_fc"](layer_norm(h, w2, b2, eps)), cfg.activation))

    def final_norm(self, x: Tensor) -> Tensor:
        weight, bias = self.ln_f
        return layer_norm(x, weight, bias, self.config.layer_norm_eps)


def build_model(model: torch.nn.Module, config: ModelConfig, max_positions: int) -> TinyCausalLM:
    """The tinygrad model for a loaded float32 engine model (its parameters are copied, the torch model is left
    as it is). ``max_positions``: the positions RoPE tables cover (Llama)."""
    params = _float_params(model)
    if config.architecture == "llama":
        return LlamaModel(config, params, max_positions)
    if config.architecture == "gpt2":
        return GPT2Model(config, params, max_positions)
    raise ValueError(f"the tinygrad runner has no {config.architecture!r} model")


def _float_params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter as a float32 NumPy array; refuses weights that are quantization codes."""
    from app.engine.models.layers import Linear as TorchLinear

    for name, module in model.named_modules():
        if isinstance(module, TorchLinear) and (
            module.scales is not None or (module.qweight is not None and module.block_rows is None)
        ):
            raise ValueError(f"{name} holds quantized weights: the tinygrad runner needs float weights")
    with torch.no_grad():
        return {name: p.detach().float().contiguous().numpy() for name, p in model.named_parameters()}
