"""The Llama family and GPT-2 as JAX forward functions over a params pytree taken from the loaded torch model.

The model is three pieces, :func:`embed`, :func:`block` (one decoder block, the same code for every layer)
and :func:`compute_logits`, each taking an ``attend(q, k, v)`` callback where it needs attention (and any cache
writes): the paged runner jits one block for all layers (their shapes are equal), the single-sequence
``layer_outputs`` runs :func:`forward` over them all with plain causal attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from app.engine.config import ModelConfig
from app.engine.frameworks.jax.layers import (
    Array,
    apply_rope,
    gelu_mlp,
    layer_norm,
    linear,
    rms_norm,
    rope_cos_sin,
    swiglu_mlp,
)
from app.engine.models.base import PagedCausalLM
from app.engine.models.layers import Linear

Params = dict[str, Any]
#: ``attend(q [T, heads, d], k [T, kv_heads, d], v [T, kv_heads, d]) -> [T, heads * d]``: one block's attention
BlockAttend = Callable[[Array, Array, Array], Array]
#: the same for every block: ``attend(layer, q, k, v)``
Attend = Callable[[int, Array, Array, Array], Array]


@dataclass(frozen=True)
class ModelSpec:
    """The static shape of a model (hashable: a static argument of the jitted step functions)."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rms_norm_eps: float
    layer_norm_eps: float
    gelu_approximate: bool

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)

    @classmethod
    def from_config(cls, config: ModelConfig) -> ModelSpec:
        return cls(
            architecture=config.architecture,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            layer_norm_eps=config.layer_norm_eps,
            gelu_approximate=config.activation != "gelu",
        )


# ---- weights ---------------------------------------------------------------------------------------------
def _array(t: torch.Tensor | None) -> Array | None:
    """A float32 JAX copy of a torch tensor (any strides: column-major weights come out contiguous)."""
    if t is None:
        return None
    return jnp.asarray(np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy()))


def _weight_t(lin: Linear) -> Array | None:
    """A Linear's weight as ``[in, out]`` (the torch CPU weights are stored column-major: ``W.T`` is free)."""
    if lin.qweight is not None or lin.scales is not None:
        raise ValueError("the jax framework runs float32 weights: load the model without quantization")
    return _array(lin.weight.t())


#: the params that are matrix-product weights (rounded to bfloat16 for bfloat16 products)
PRODUCT_WEIGHTS = frozenset({"qkv", "o", "gate_up", "down", "fc", "proj", "head"})


def params_from_torch(model: PagedCausalLM, config: ModelConfig, bfloat16_products: bool = False) -> Params:
    """The params pytree of a loaded float32 (or bfloat16, widened) engine model; ``bfloat16_products``: the
    product weights (:data:`PRODUCT_WEIGHTS`, the LM head included) in bfloat16, the rest (embeddings, norms,
    biases) in float32."""
    if config.architecture == "llama":
        params = _llama_params(model, config)
    elif config.architecture == "gpt2":
        params = _gpt2_params(model)
    else:
        raise ValueError(f"the jax framework has no {config.architecture!r} model")
    if bfloat16_products:
        params = _round_products(params)
    return params


def _round_products(params: Params) -> Params:
    def rounded(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v.astype(jnp.bfloat16) if k in PRODUCT_WEIGHTS else v for k, v in group.items()}

    out = rounded({k: v for k, v in params.items() if k != "layers"})
    out["layers"] = [rounded(layer) for layer in params["layers"]]
    return out


def _llama_params(model: Any, config: ModelConfig) -> Params:
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            {
                "ln1": _array(layer.input_layernorm.weight),
                "ln2": _array(layer.post_attention_layernorm.weight),
                "qkv": _weight_t(attn.qkv_proj),
                "qkv_b": _array(attn.qkv_proj.bias),
                "o": _weight_t(attn.o_proj),
                "o_b": _array(attn.o_proj.bias),
                "gate_up": _weight_t(mlp.gate_up_proj),
                "gate_up_b": _array(mlp.gate_up_proj.bias),
                "down": _weight_t(mlp.down_proj),
                "down_b": _array(mlp.down_proj.bias),
            }
        )
    return {
        "embed": _array(model.embed_tokens.weight),
        "layers": layers,
        "norm": _array(model.norm.weight),
        # its own [hidden, vocab] copy even when tied: the product reads it row-major, the lookup the embedding
        "head": _array(model.lm_head_weight().t()),
        "inv_freq": _array(config.rope_inv_freq()),
    }


def _gpt2_params(model: Any) -> Params:
    layers = []
    for block in model.h:
        layers.append(
            {
                "ln1_w": _array(block.ln_1.weight),
                "ln1_b": _array(block.ln_1.bias),
                "ln2_w": _array(block.ln_2.weight),
                "ln2_b": _array(block.ln_2.bias),
                "qkv": _weight_t(block.attn.c_attn),
                "qkv_b": _array(block.attn.c_attn.bias),
                "o": _weight_t(block.attn.c_proj),
                "o_b": _array(block.attn.c_proj.bias),
                "fc": _weight_t(block.mlp.c_fc),
                "fc_b": _array(block.mlp.c_fc.bias),
                "proj": _weight_t(block.mlp.c_proj),
                "proj_b": _array(block.mlp.c_proj.bias),
            }
        )
    return {
        "wte": _array(model.wte.weight),
        "wpe": _array(model.wpe.weight),
        "layers": layers,
        "ln_f_w": _array(model.ln_f.weight),
        "ln_f_b": _array(model.ln_f.bias),
        "head": _array(model.lm_head_weight().t()),
    }


# ---- forward ---------------------------------------------------------------------------------------------
def embed(top: Params, spec: ModelSpec, ids: Array, positions: Array) -> tuple[Array, Any]:
    """The embeddings ``[T, hidden]`` and what every block shares: RoPE's ``(cos, sin)`` (None for GPT-2's
    learned positions, added here). ``top``: the params without ``"layers"``."""
    if spec.architecture == "llama":
        return top["embed"][ids], rope_cos_sin(positions, top["inv_freq"])
    return top["wte"][ids] + top["wpe"][positions], None


def block(p: Params, spec: ModelSpec, x: Array, rope: Any, attend: BlockAttend) -> Array:
    """One decoder block over the residual stream ``x [T, hidden]``; returns the stream after it."""
    length = x.shape[0]
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if spec.architecture == "llama":
        eps = spec.rms_norm_eps
        cos, sin = rope
        qkv = linear(rms_norm(x, p["ln1"], eps), p["qkv"], p["qkv_b"])
        q = apply_rope(qkv[:, :q_size].reshape(length, heads, head_dim), cos, sin)
        k = apply_rope(qkv[:, q_size : q_size + kv_size].reshape(length, kv_heads, head_dim), cos, sin)
        v = qkv[:, q_size + kv_size :].reshape(length, kv_heads, head_dim)
        x = x + linear(attend(q, k, v), p["o"], p["o_b"])
        return x + swiglu_mlp(
            rms_norm(x, p["ln2"], eps), p["gate_up"], p["down"], p["gate_up_b"], p["down_b"]
        )
    eps = spec.layer_norm_eps
    qkv = linear(layer_norm(x, p["ln1_w"], p["ln1_b"], eps), p["qkv"], p["qkv_b"])
    q, k, v = (qkv[:, i * q_size : (i + 1) * q_size].reshape(length, heads, head_dim) for i in range(3))
    x = x + linear(attend(q, k, v), p["o"], p["o_b"])
    h = layer_norm(x, p["ln2_w"], p["ln2_b"], eps)
    return x + gelu_mlp(h, p["fc"], p["fc_b"], p["proj"], p["proj_b"], spec.gelu_approximate)


def forward(
    params: Params,
    spec: ModelSpec,
    ids: Array,
    positions: Array,
    attend: Attend,
    collect: list[Array] | None = None,
) -> Array:
    """The residual stream after the last block, ``[T, hidden]`` (before the final norm). ``collect``: append
    the embeddings and each block's output to it."""
    x, rope = embed(params, spec, ids, positions)
    if collect is not None:
        collect.append(x)
    for index, p in enumerate(params["layers"]):
        x = block(p, spec, x, rope, functools.partial(attend, index))
        if collect is not None:
            collect.append(x)
    return x


def final_norm(top: Params, spec: ModelSpec, x: Array) -> Array:
    if spec.architecture == "llama":
        return rms_norm(x, top["norm"], spec.rms_norm_eps)
    return layer_norm(x, top["ln_f_w"], top["ln_f_b"], spec.layer_norm_eps)


def compute_logits(top: Params, spec: ModelSpec, x: Array) -> Array:
    """Logits ``[rows, vocab]`` of residual-stream rows (the final norm applied here; float32 sums)."""
    return linear(final_norm(top, spec, x), top["head"])
