"""The Llama family and GPT-2 on tinygrad Tensors, over weights converted from the loaded PyTorch model.

Weights come from :meth:`torch.nn.Module.named_parameters` of :class:`app.engine.models.llama.LlamaForCausalLM` or
:class:`app.engine.models.gpt2.GPT2LMHeadModel` (fused ``qkv_proj``/``gate_up_proj`` and GPT-2's ``c_attn`` are
already ``[out, in]``), so whatever the engine loads (GGUF, HF folders) runs here too.

A step runs in three parts, each a function of Tensors only (the runner TinyJits each): :meth:`embed` (token
embeddings, and what every layer shares: Llama's RoPE rows), :meth:`layer` (one decoder block, its weights passed as
arguments: one capture serves every layer), :meth:`head` (final norm and the logits of the sampling rows).
:meth:`forward` chains them eagerly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
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
    product,
    rms_norm,
    rms_scale,
    rope,
    swiglu,
    write_kv,
)

__all__ = ["GPT2Model", "LlamaModel", "StepTensors", "TinyCausalLM", "build_model"]


@dataclass
class StepTensors:
    """What every layer of a step reads (int32): ``T`` rows, ``W`` blocks per row's table."""

    positions: Tensor  # [T]
    slots: Tensor  # [T] cache slot of each new token (padding rows: the scratch block)
    block_tables: Tensor  # [T, W] the block table of each row's sequence
    shared: tuple[Tensor, ...] = ()  # what embed() computed for every layer (Llama: RoPE cos and sin rows)


def _tensor(array: np.ndarray) -> Tensor:
    return Tensor(np.ascontiguousarray(array, dtype=np.float32))


class TinyCausalLM(ABC):
    """Shared by both architectures: weights by name, per-layer weight lists, the LM head, :meth:`forward`."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], head_norm: str | None = None) -> None:
        self.config = config
        self._params = params
        self._built: list[Tensor] = []  # realized together once the model is built (one schedule, not hundreds)
        self.scale = config.head_dim**-0.5
        norm = None if head_norm is None else params[head_norm]
        self.lm_head = self._keep(Linear(params[self._head_name()], norm=norm))
        self.layers: list[dict[str, Tensor]] = []
        self.out_features: dict[str, int] = {}

    @abstractmethod
    def _head_name(self) -> str:
        """The name of the LM head's weight in ``params``."""

    def take(self, name: str) -> Tensor:
        t = _tensor(self._params[name])
        self._built.append(t)
        return t

    def _keep(self, linear: Linear) -> Linear:
        self._built.extend(linear.tensors())
        return linear

    def take_linear(
        self, weights: dict[str, Tensor], key: str, name: str, norm: str | None = None, rows: slice | None = None
    ) -> None:
        """Linear ``name`` (checkpoint prefix; its output ``rows`` only) into ``weights[key + ".panels"]`` (and
        ``".bias"``), with RMSNorm weight ``norm`` folded in."""
        weight, bias = self._params[name + ".weight"], self._params.get(name + ".bias")
        if rows is not None:
            weight, bias = weight[rows], None if bias is None else bias[rows]
        lin = self._keep(Linear(weight, bias, None if norm is None else self._params[norm]))
        weights[key + ".panels"] = lin.panels
        if lin.bias is not None:
            weights[key + ".bias"] = lin.bias
        self.out_features[key] = lin.out_features

    def finish(self, *extra: Tensor) -> None:
        """Realize every weight (and ``extra`` tables) in one go and drop the NumPy copies."""
        Tensor.realize(*self._built, *extra)
        self._built, self._params = [], {}

    def proj(self, x: Tensor, w: dict[str, Tensor], key: str, **epilogue: Any) -> Tensor:
        """Linear ``key`` of a layer on ``x`` (see :func:`.layers.product` for the ``epilogue``)."""
        return product(x, w[key + ".panels"], self.out_features[key], bias=w.get(key + ".bias"), **epilogue)

    # ---- the three parts of a step ----
    #: what :meth:`embed` returns besides the embeddings, for every layer
    shared_names: tuple[str, ...] = ()

    def weight_names(self) -> list[str]:
        """The names of a layer's weights, in the order :meth:`layer_weights` gives them."""
        return sorted(self.layers[0])

    def layer_weights(self, index: int) -> list[Tensor]:
        layer = self.layers[index]
        return [layer[name] for name in self.weight_names()]

    @abstractmethod
    def embed(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """``(x, *shared)``: the embeddings ``[T, hidden]`` and what every layer reads."""

    @abstractmethod
    def layer(self, x: Tensor, weights: Sequence[Tensor], step: StepTensors, caches: Any, layer: Tensor) -> Tensor:
        """One decoder block on ``x``; ``weights`` in :meth:`weight_names` order; ``layer`` (int32 ``[1]``) picks its
        part of the KV caches."""

    @abstractmethod
    def final_norm(self, x: Tensor) -> Tensor:
        """The model's last norm on ``x``."""

    def head(self, x: Tensor, sample_rows: Tensor) -> Tensor:
        """Logits ``[S, vocab]`` of rows ``sample_rows`` (after the final norm)."""
        return self.lm_head(gather_rows(self.final_norm(x), sample_rows))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: StepTensors, caches: Any, layer: Tensor) -> Tensor:
        """Write this step's keys and values, then attend (see :func:`.layers.paged_attention`)."""
        k_cache, v_cache = write_kv(caches.keys, caches.values, k, v, step.slots, layer)
        return paged_attention(q, k_cache, v_cache, step.block_tables, step.positions, layer, self.scale)

    def forward(
        self,
        ids: Tensor,
        step: StepTensors,
        sample_rows: Tensor,
        caches: Any,
        layer_ids: Sequence[Tensor],
        collect: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """The three parts chained, eagerly (``step.shared`` is filled here). ``collect`` receives the residual
        stream after the embeddings and each block, and the final norm's output."""
        x, *shared = self.embed(ids, step.positions)
        step = StepTensors(step.positions, step.slots, step.block_tables, tuple(shared))
        if collect is not None:
            collect["embeddings"] = x
        for index in range(self.config.num_layers):
            x = self.layer(x, self.layer_weights(index), step, caches, layer_ids[index]).contiguous()
            if collect is not None:
                collect[f"block.{index}"] = x
        if collect is not None:
            collect["final_norm"] = self.final_norm(x)
        return self.head(x, sample_rows)


class LlamaModel(TinyCausalLM):
    """Llama: RMSNorm, RoPE (theta and scaling through ``ModelConfig.rope_inv_freq``), GQA/MQA, SwiGLU, optional
    biases and tied head."""

    shared_names = ("cos", "sin")

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], max_positions: int) -> None:
        super().__init__(config, params, head_norm="norm.weight")
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

    def _layer(self, p: str) -> dict[str, Tensor]:
        """The layer's weights: both RMSNorm weights folded into the products after them; without MLP biases the
        gate and up projections are separate panel weights that one kernel multiplies into SwiGLU."""
        w: dict[str, Tensor] = {}
        inter = self.config.intermediate_size
        attn_norm, mlp_norm = p + "input_layernorm.weight", p + "post_attention_layernorm.weight"
        self.take_linear(w, "qkv", p + "self_attn.qkv_proj", norm=attn_norm)
        self.take_linear(w, "o", p + "self_attn.o_proj")
        if self.config.mlp_bias:
            self.take_linear(w, "gate_up", p + "mlp.gate_up_proj", norm=mlp_norm)
        else:
            self.take_linear(w, "gate", p + "mlp.gate_up_proj", norm=mlp_norm, rows=slice(0, inter))
            self.take_linear(w, "up", p + "mlp.gate_up_proj", norm=mlp_norm, rows=slice(inter, 2 * inter))
        self.take_linear(w, "down", p + "mlp.down_proj")
        return w

    def embed(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        x = gather_rows(self.embed_tokens, ids)
        return x, gather_rows(self.cos, positions), gather_rows(self.sin, positions)

    def layer(self, x: Tensor, weights: Sequence[Tensor], step: StepTensors, caches: Any, layer: Tensor) -> Tensor:
        cfg, w = self.config, dict(zip(self.weight_names(), weights, strict=True))
        rows, hd = x.shape[0], cfg.head_dim
        q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        cos, sin = step.shared
        qkv = self.proj(x, w, "qkv", scale=rms_scale(x, cfg.rms_norm_eps))
        q = rope(qkv[:, :q_size].reshape(rows, cfg.num_heads, hd), cos, sin)
        k = rope(qkv[:, q_size : q_size + kv_size].reshape(rows, cfg.num_kv_heads, hd), cos, sin)
        attn = self.attend(q, k.reshape(rows, kv_size), qkv[:, q_size + kv_size :], step, caches, layer)
        h = self.proj(attn, w, "o", residual=x)
        scale = rms_scale(h, cfg.rms_norm_eps)
        if cfg.mlp_bias:
            mid = swiglu(self.proj(h, w, "gate_up", scale=scale), cfg.intermediate_size)
        else:
            mid = self.proj(h, w, "gate", scale=scale, gate=w["up.panels"])
        return self.proj(mid, w, "down", residual=h)

    def final_norm(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def head(self, x: Tensor, sample_rows: Tensor) -> Tensor:
        """The final norm folded into the head: its weight into the head's panels, its factor per sampled row."""
        rows = gather_rows(x, sample_rows)
        scale = rms_scale(rows, self.config.rms_norm_eps)
        return product(rows, self.lm_head.panels, self.lm_head.out_features, scale=scale)


class GPT2Model(TinyCausalLM):
    """GPT-2: learned positions, LayerNorm, GELU, fused ``c_attn``, biases everywhere."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], max_positions: int) -> None:
        super().__init__(config, params)
        self.wte = self.take("wte.weight")
        self.wpe = self.take("wpe.weight")
        self.layers = [self._block(f"h.{i}.") for i in range(config.num_layers)]
        self.ln_f = (self.take("ln_f.weight"), self.take("ln_f.bias"))
        self.finish()

    def _head_name(self) -> str:
        return "wte.weight" if self.config.tie_word_embeddings else "lm_head"

    def _block(self, p: str) -> dict[str, Tensor]:
        w = {name: self.take(p + name) for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")}
        self.take_linear(w, "c_attn", p + "attn.c_attn")
        self.take_linear(w, "attn_proj", p + "attn.c_proj")
        self.take_linear(w, "c_fc", p + "mlp.c_fc")
        self.take_linear(w, "mlp_proj", p + "mlp.c_proj")
        return w

    def embed(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        return (gather_rows(self.wte, ids) + gather_rows(self.wpe, positions),)

    def layer(self, x: Tensor, weights: Sequence[Tensor], step: StepTensors, caches: Any, layer: Tensor) -> Tensor:
        cfg, w = self.config, dict(zip(self.weight_names(), weights, strict=True))
        rows, embed = x.shape[0], cfg.num_heads * cfg.head_dim
        eps = cfg.layer_norm_eps
        qkv = self.proj(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, "c_attn")
        q = qkv[:, :embed].reshape(rows, cfg.num_heads, cfg.head_dim)
        attn = self.attend(q, qkv[:, embed : 2 * embed], qkv[:, 2 * embed :], step, caches, layer)
        h = self.proj(attn, w, "attn_proj", residual=x)
        mid = gelu(self.proj(layer_norm(h, w["ln_2.weight"], w["ln_2.bias"], eps), w, "c_fc"), cfg.activation)
        return self.proj(mid, w, "mlp_proj", residual=h)

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
