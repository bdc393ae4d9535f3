"""The building blocks of the JAX models as pure functions: norms, RoPE, MLPs and paged attention.

Everything is float32 and written to match transformers' arithmetic (RMSNorm as Llama computes it, RoPE in
the "rotate half" layout, GELU's tanh approximation for ``gelu_new``).

The paged KV cache of one layer is a pair of arrays ``[kv_heads, num_slots, head_dim]``; slot ``s`` holds the
key (value) of logical position ``p`` of a sequence when ``s = table[p // block_size] * block_size + p %
block_size``. Heads come first so that gathering a sequence's blocks gives ``[kv_heads, batch, context,
head_dim]`` directly, the layout of a batched product, without a transpose.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = Any  # jax.Array; jax's own annotations are awkward around tracers and pytrees

# Below this many parameters a step takes microseconds whatever the code generation, and compiling it is what
# costs (each shape is seconds of LLVM on a small CPU): such models compile without LLVM's optimisations.
FAST_COMPILE_PARAMS = 20_000_000
# Matrix products and their fusions by YNNPACK, jax 0.10's default on CPU (an empty dict keeps it; setting
# xla_cpu_experimental_ynn_fusion_type to "" would give XLA's own Eigen products). Measured on a 2-core Xeon with
# AVX-512 and AMX: a SmolLM2 decode layer of 8 to 64 rows 1.6-1.9x faster than Eigen (its batched attention products
# most of all), workload A 177 -> 233 tok/s, a single stream the same (16-19 tok/s both), and equal with another
# busy process on the machine (144 and 146 tok/s). An earlier AMD EPYC measurement had Eigen 25% faster at 8 rows
# for the products alone; the whole layer is what a step runs.
_DOT_OPTIONS: dict[str, str] = {}

# Masked attention scores: finite, so a row with every key masked (a padding row) stays finite instead of NaN;
# exp() of it underflows to exactly 0 next to any real score, so real rows are the same as with -inf.
MASKED = -1e30


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Llama RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))``."""
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return weight * (x * jax.lax.rsqrt(variance + eps))


def layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(variance + eps) * weight + bias


def linear(x: Array, weight_t: Array, bias: Array | None = None) -> Array:
    """``x @ W.T + b`` with the weight stored transposed (``[in, out]``), as the products read it. A bfloat16
    weight takes ``x`` rounded to bfloat16 and sums in float32 (the output is float32 either way)."""
    if weight_t.dtype == jnp.bfloat16:
        out = jnp.dot(x.astype(jnp.bfloat16), weight_t, preferred_element_type=jnp.float32)
    else:
        out = x @ weight_t
    return out if bias is None else out + bias


def rope_cos_sin(positions: Array, inv_freq: Array) -> tuple[Array, Array]:
    """Half-width cos/sin ``[T, 1, head_dim // 2]``: the same float32 product of positions and inverse
    frequencies that transformers computes, so the angles are the same bits."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate ``x [T, heads, head_dim]`` in the "rotate half" layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def swiglu_mlp(
    x: Array, gate_up_t: Array, down_t: Array, gate_up_b: Array | None, down_b: Array | None
) -> Array:
    """Llama's MLP over the fused ``[gate | up]`` projection: ``down(silu(gate) * up)``."""
    gate_up = linear(x, gate_up_t, gate_up_b)
    half = gate_up.shape[-1] // 2
    return linear(jax.nn.silu(gate_up[:, :half]) * gate_up[:, half:], down_t, down_b)


def gelu_mlp(x: Array, fc_t: Array, fc_b: Array, proj_t: Array, proj_b: Array, approximate: bool) -> Array:
    """GPT-2's MLP; ``approximate``: the tanh GELU of ``gelu_new`` (plain ``gelu`` is the exact erf)."""
    return linear(jax.nn.gelu(linear(x, fc_t, fc_b), approximate=approximate), proj_t, proj_b)


@functools.cache
def jitted(
    fn: Callable[..., Any], fast_compile: bool, static: tuple[str, ...], donate: tuple[str, ...]
) -> Any:
    """``jax.jit(fn)`` with these static and donated arguments, compiled fast (unoptimised) or not; one
    wrapper per combination, so its compiled shapes are shared by every runner in the process."""
    options: dict[str, Any] = dict(_DOT_OPTIONS)
    if fast_compile:
        options["xla_backend_optimization_level"] = 0
    return jax.jit(fn, static_argnames=static, donate_argnames=donate, compiler_options=options)


# ---- the paged KV cache ----------------------------------------------------------------------------------
def write_kv(cache: Array, slots: Array, new: Array) -> Array:
    """``new [T, kv_heads, head_dim]`` stored at ``slots [T]`` of ``cache [kv_heads, slots, head_dim]``.

    Padding rows all write one scratch slot that no sequence reads, so their order does not matter."""
    return cache.at[:, slots].set(new.transpose(1, 0, 2), mode="promise_in_bounds")


def gather_blocks(cache: Array, tables: Array, block_size: int) -> Array:
    """The context of each sequence, ``[kv_heads, B, W * block_size, head_dim]``, from its block table
    ``[B, W]`` (entries past a sequence's blocks point at the scratch block and are masked)."""
    kv_heads, num_slots, head_dim = cache.shape
    batch, width = tables.shape
    blocks = cache.reshape(kv_heads, num_slots // block_size, block_size, head_dim)
    return blocks[:, tables].reshape(kv_heads, batch, width * block_size, head_dim)


def decode_attention(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    tables: Array,
    context_lens: Array,
    scale: float,
    block_size: int,
) -> Array:
    """One query per sequence (``q [B, heads, head_dim]``, its K/V already in the cache) against that
    sequence's first ``context_lens`` positions; returns ``[B, heads * head_dim]``.

    Grouped-query heads ride in the query axis of the product, so K/V are never repeated."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    keys = gather_blocks(k_cache, tables, block_size)
    values = gather_blocks(v_cache, tables, block_size)
    qg = q.reshape(batch, kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [kvh, B, g, d]
    scores = jnp.einsum("kbgd,kbcd->kbgc", qg, keys) * scale
    keep = jnp.arange(keys.shape[2])[None, :] < context_lens[:, None]  # [B, C]
    probs = jax.nn.softmax(jnp.where(keep[None, :, None, :], scores, MASKED), axis=-1)
    out = jnp.einsum("kbgc,kbcd->kbgd", probs, values)
    return out.transpose(1, 0, 2, 3).reshape(batch, num_heads * head_dim)


def prefill_attention(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    tables: Array,
    context_lens: Array,
    first_pos: Array,
    scale: float,
    block_size: int,
) -> Array:
    """Chunks of several queries per sequence (``q [B, Q, heads, head_dim]``, query ``i`` of sequence ``b``
    at position ``first_pos[b] + i``, all K/V already in the cache): causal within the chunk, everything
    before it from the cache (a cached prefix or earlier chunks). Returns ``[B * Q, heads * head_dim]``."""
    batch, num_queries, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    keys = gather_blocks(k_cache, tables, block_size)
    values = gather_blocks(v_cache, tables, block_size)
    context = keys.shape[2]
    # [kvh, B, g * Q, d]: the group's heads and the chunk's queries share the rows of one product
    qg = q.reshape(batch, num_queries, kv_heads, group, head_dim).transpose(2, 0, 3, 1, 4)
    qg = qg.reshape(kv_heads, batch, group * num_queries, head_dim)
    scores = jnp.einsum("kbqd,kbcd->kbqc", qg, keys) * scale
    scores = scores.reshape(kv_heads, batch, group, num_queries, context)
    positions = first_pos[:, None] + jnp.arange(num_queries)[None, :]  # [B, Q]
    key_pos = jnp.arange(context)[None, None, :]
    keep = (key_pos <= positions[:, :, None]) & (key_pos < context_lens[:, None, None])  # [B, Q, C]
    probs = jax.nn.softmax(jnp.where(keep[None, :, None], scores, MASKED), axis=-1)
    probs = probs.reshape(kv_heads, batch, group * num_queries, context)
    out = jnp.einsum("kbqc,kbcd->kbqd", probs, values)
    out = out.reshape(kv_heads, batch, group, num_queries, head_dim).transpose(1, 3, 0, 2, 4)
    return out.reshape(batch * num_queries, num_heads * head_dim)


def causal_attention(q: Array, k: Array, v: Array, scale: float) -> Array:
    """Plain causal attention of one sequence over its own ``q [T, heads, d]``, ``k, v [T, kv_heads, d]``
    (no cache): the single-sequence forward of ``layer_outputs``."""
    length, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    qg = q.reshape(length, kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k) * scale
    keep = jnp.arange(length)[None, :] <= jnp.arange(length)[:, None]  # [T, S]
    probs = jax.nn.softmax(jnp.where(keep, scores, MASKED), axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", probs, v)
    return out.reshape(length, num_heads * head_dim)
