"""Model building blocks on tinygrad Tensors: linear layers on panel weights, norms, RoPE, MLPs, and paged attention
over a block KV cache (the KV write is a small custom kernel: a scatter by cache slot).

Shapes follow the engine's flat batch: ``T`` token rows (prefill chunks and decodes of several sequences laid end to
end), each with its own position and its own row of block ids, so one attention call serves any mix of prefills and
decodes: token ``t`` attends to the key positions ``<= positions[t]`` of its sequence, read through its block table
(the tokens written this step included, which makes it causal within a chunk).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

from app.engine.frameworks.tinygrad import kernels
from app.engine.frameworks.tinygrad.tuning import PANEL, attention_tiles, product_opts

__all__ = [
    "Linear",
    "dims",
    "gather_rows",
    "gelu",
    "layer_norm",
    "paged_attention",
    "panels",
    "product",
    "rms_norm",
    "rms_scale",
    "rope",
    "swiglu",
    "write_kv",
]


class Linear:
    """``y = x @ W.T + b`` with ``W`` stored as panels ``[ceil(out / PANEL), in, PANEL]`` (zero rows pad the last
    panel, so a product streams its weight in memory order) and computed by a custom kernel carrying its own
    optimizations (see :mod:`.tuning`). ``norm``: the weight of an RMSNorm before it, folded into the columns of
    ``W`` (the product then takes the norm's per-row scale, see :func:`product`). Its tensors are realized by the
    model, all in one schedule."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None, norm: np.ndarray | None = None) -> None:
        out_features, in_features = weight.shape
        self.panels = Tensor(panels(weight if norm is None else weight * norm[None, :]))
        self.bias: Tensor | None = None
        if bias is not None:
            b = np.zeros(self.panels.shape[0] * PANEL, dtype=np.float32)
            b[:out_features] = bias
            self.bias = Tensor(b)
        self.in_features = in_features
        self.out_features = out_features

    def tensors(self) -> list[Tensor]:
        return [self.panels] if self.bias is None else [self.panels, self.bias]

    def __call__(self, x: Tensor) -> Tensor:
        return product(x, self.panels, self.out_features, bias=self.bias)


def panels(weight: np.ndarray) -> np.ndarray:
    """``[out, in]`` as float32 panels ``[ceil(out / PANEL), in, PANEL]`` (zero rows pad the last one)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL) * PANEL
    w = np.zeros((padded, in_features), dtype=np.float32)
    w[:out_features] = weight
    return np.ascontiguousarray(w.reshape(padded // PANEL, PANEL, in_features).transpose(0, 2, 1))


def product(
    x: Tensor,
    weight: Tensor,
    out_features: int,
    *,
    scale: Tensor | None = None,
    gate: Tensor | None = None,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """``x @ W.T`` for panel weights, with its epilogue in the same kernel: ``* scale[t]`` (an RMSNorm folded into
    ``W``), ``silu(.) * (x @ gate.T)`` (SwiGLU: ``gate`` holds the up projection's panels), ``+ bias``, ``+
    residual``."""
    rows = dims(x)[0]
    n_panels, k, p = dims(weight)
    group, row_tile, panel_tile = product_opts(rows, n_panels, k, sums=1 if gate is None else 2)
    named = {"scale": scale, "gate": gate, "bias": bias, "residual": residual}
    parts = tuple(name for name, t in named.items() if t is not None)
    extra = [t.contiguous() for t in named.values() if t is not None]
    if residual is not None and n_panels * p != out_features:  # the kernel adds it by padded column
        extra[-1] = residual.pad(((0, 0), (0, n_panels * p - out_features))).contiguous()
    fxn = functools.partial(
        kernels.product_kernel, group=group, row_tile=row_tile, panel_tile=panel_tile, parts=parts
    )
    y = _custom(fxn, (rows, n_panels * p), x.contiguous(), weight, *extra)
    return y if n_panels * p == out_features else y[:, :out_features]


def rms_scale(x: Tensor, eps: float) -> Tensor:
    """RMSNorm's per-row factor ``rsqrt(mean(x^2) + eps)``, ``[T]``."""
    return (x.square().mean(-1) + eps).rsqrt()


def dims(t: Tensor) -> tuple[int, ...]:
    """A Tensor's shape as ints (the runner's shapes are never symbolic)."""
    return tuple(int(s) for s in t.shape)


def _custom(fxn: Any, shape: tuple[int, ...], *srcs: Tensor) -> Tensor:
    """Run custom kernel ``fxn`` into a new float32 Tensor of ``shape``."""
    out = Tensor.empty(*shape, dtype=dtypes.float32, device=srcs[0].device)
    result: Tensor = Tensor.custom_kernel(out, *srcs, fxn=fxn)[0]
    return result


def gather_rows(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a 2-D table and int32 ``index [T]``."""
    return _custom(kernels.gather_rows_kernel, (dims(index)[0], dims(table)[1]), table, index)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm in float32: ``x * rsqrt(mean(x^2) + eps) * w``."""
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * weight


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return x.layernorm(eps=eps) * weight + bias


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [T, heads, head_dim]`` in the "rotate half" layout (HF); ``cos``/``sin`` are ``[T, head_dim/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x1 * c - x2 * s).cat(x2 * c + x1 * s, dim=-1)


def swiglu(gate_up: Tensor, intermediate: int) -> Tensor:
    """``silu(gate) * up`` of a fused ``[gate | up]`` projection."""
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    return gate.silu() * up


def gelu(x: Tensor, activation: str) -> Tensor:
    """GPT-2's activations: ``gelu_new`` / ``gelu_pytorch_tanh`` (tanh approximation) or exact ``gelu``."""
    return x.gelu(approximate="none" if activation == "gelu" else "tanh")


# ---- paged attention -------------------------------------------------------------------------------------------
def write_kv(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, layer: Tensor
) -> tuple[Tensor, Tensor]:
    """Write the step's keys and values ``[T, kv_heads * head_dim]`` into cache ``slots [T]`` of layer ``layer``
    (int32 ``[1]``; cache layouts: :mod:`.kernels`); returns the caches as they are after the write (read them, not
    the arguments, in this step)."""
    outs: list[Any] = Tensor.custom_kernel(
        k_cache, v_cache, k.contiguous(), v.contiguous(), slots, layer, fxn=kernels.kv_write_kernel
    )
    return outs[0], outs[1]


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    positions: Tensor,
    layer: Tensor,
    scale: float,
) -> Tensor:
    """Attention of ``q [T, heads, head_dim]`` over the key positions ``<= positions[t]`` of each row's sequence,
    read through ``block_tables [T, W]`` from layer ``layer``'s caches. Grouped-query heads share their kv head's
    keys (no repeat). Returns ``[T, heads * head_dim]``."""
    rows, heads, head_dim = dims(q)
    _, _, kv_heads, _, block_size = dims(k_cache)
    group, blocks = heads // kv_heads, dims(block_tables)[1]
    width = blocks * block_size
    (key_lanes, heads_s), (dim_lanes, heads_v) = attention_tiles(group, block_size, head_dim)
    qg = q.reshape(rows, kv_heads, group, head_dim).contiguous()
    scores_fxn = functools.partial(kernels.attention_scores_kernel, scale=scale, lanes=key_lanes, heads=heads_s)
    scores = _custom(scores_fxn, (rows, kv_heads, group, width), qg, k_cache, block_tables, positions, layer)
    visible = Tensor.arange(width, dtype=dtypes.int32).reshape(1, 1, 1, width) <= positions.reshape(rows, 1, 1, 1)
    masked = visible.where(scores, -math.inf)
    weights = (masked - masked.max(-1, keepdim=True)).exp().contiguous()  # softmax before its division
    values_fxn = functools.partial(kernels.attention_values_kernel, lanes=dim_lanes, heads=heads_v)
    out = _custom(values_fxn, (rows, kv_heads, group, head_dim), weights, v_cache, block_tables, layer)
    return out.reshape(rows, heads * head_dim)
