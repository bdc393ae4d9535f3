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
from app.engine.frameworks.tinygrad.tuning import PANEL, attention_opts, product_opts

__all__ = [
    "Linear",
    "gather_rows",
    "gelu",
    "layer_norm",
    "paged_attention",
    "rms_norm",
    "rope",
    "swiglu",
    "write_kv",
]


class Linear:
    """``y = x @ W.T + b`` with ``W`` stored as panels ``[ceil(out / PANEL), in, PANEL]`` (zero rows pad the last
    panel, so a product streams its weight in memory order) and computed by a custom kernel carrying its own
    optimizations (see :mod:`.tuning`). Its tensors are realized by the model, all in one schedule."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        out_features, in_features = weight.shape
        padded = -(-out_features // PANEL) * PANEL
        w = np.zeros((padded, in_features), dtype=np.float32)
        w[:out_features] = weight
        panels = w.reshape(padded // PANEL, PANEL, in_features).transpose(0, 2, 1)
        self.panels = Tensor(np.ascontiguousarray(panels))
        self.bias: Tensor | None = None
        if bias is not None:
            b = np.zeros(padded, dtype=np.float32)
            b[:out_features] = bias
            self.bias = Tensor(b)
        self.in_features = in_features
        self.out_features = out_features

    def tensors(self) -> list[Tensor]:
        return [self.panels] if self.bias is None else [self.panels, self.bias]

    def __call__(self, x: Tensor) -> Tensor:
        rows = dims(x)[0]
        n_panels, k, p = dims(self.panels)
        group, opts = product_opts(rows, n_panels, k)
        fxn = functools.partial(kernels.product_kernel, group=group, opts=opts)
        srcs = (x.contiguous(), self.panels) if self.bias is None else (x.contiguous(), self.panels, self.bias)
        y = _custom(fxn, (rows, n_panels * p), *srcs)
        return y if n_panels * p == self.out_features else y[:, : self.out_features]


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
def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Write the step's keys and values ``[T, kv_heads * head_dim]`` into their cache ``slots [T]`` (cache layouts:
    :mod:`.kernels`); returns the caches as they are after the write (read them, not the arguments, in this step)."""
    outs: list[Any] = Tensor.custom_kernel(
        k_cache, v_cache, k.contiguous(), v.contiguous(), slots, fxn=kernels.kv_write_kernel
    )
    return outs[0], outs[1]


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, positions: Tensor, scale: float
) -> Tensor:
    """Attention of ``q [T, heads, head_dim]`` over the key positions ``<= positions[t]`` of each row's sequence,
    read through ``block_tables [T, W]`` from the caches. Grouped-query heads share their kv head's keys (no
    repeat). Returns ``[T, heads * head_dim]``."""
    rows, heads, head_dim = dims(q)
    _, kv_heads, _, block_size = dims(k_cache)
    group, blocks = heads // kv_heads, dims(block_tables)[1]
    width = blocks * block_size
    score_opts, value_opts = attention_opts(rows, kv_heads, blocks, group, block_size, head_dim)
    qg = q.reshape(rows, kv_heads, group, head_dim).contiguous()
    scores_fxn = functools.partial(kernels.attention_scores_kernel, scale=scale, opts=score_opts)
    scores = _custom(scores_fxn, (rows, kv_heads, group, width), qg, k_cache, block_tables, positions)
    visible = Tensor.arange(width, dtype=dtypes.int32).reshape(1, 1, 1, width) <= positions.reshape(rows, 1, 1, 1)
    probs = visible.where(scores, -math.inf).softmax(-1).contiguous()
    values_fxn = functools.partial(kernels.attention_values_kernel, opts=value_opts)
    out = _custom(values_fxn, (rows, kv_heads, group, head_dim), probs, v_cache, block_tables, positions)
    return out.reshape(rows, heads * head_dim)
