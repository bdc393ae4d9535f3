"""Decode attention read straight from the paged KV cache, by the C kernel ``paged_attention.c``."""

from __future__ import annotations

import torch

import app.engine.kernels.library as library


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    rows: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Attention of one query token per sequence over its cached context; False when it does not apply.

    ``query`` is ``[T, heads, head_dim]`` (the new K/V already written to the cache), ``kv_cache`` one layer's
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` (float32 or bfloat16), ``block_tables`` ``[seqs, width]`` int64 (every entry a
    valid block id), ``context_lens`` ``[seqs]`` int64, ``rows`` the query row of each sequence (None: row i is
    sequence i). Writes those rows of ``out`` ``[T, heads * head_dim]``.
    """
    lib = library.get()
    if lib is None:
        return False
    num_tokens, heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    if (
        query.dtype != torch.float32
        or kv_cache.dtype not in (torch.float32, torch.bfloat16)
        or out.dtype != torch.float32
        or query.device.type != "cpu"
        or kv_cache.device.type != "cpu"
        or head_dim % 8
        or head_dim > 128
        or heads % kv_heads
        or query.stride(2) != 1
        or query.stride(1) != head_dim
        or not kv_cache.is_contiguous()
        or not out.is_contiguous()
        or out.shape != (num_tokens, heads * head_dim)
        or not block_tables.is_contiguous()
        or block_tables.dtype != torch.int64
        or context_lens.dtype != torch.int64
        or not context_lens.is_contiguous()
        or (rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()))
    ):
        return False
    threads = torch.get_num_threads()
    # Scores, then int64 cache-row indices; even, so every thread's part stays 8-byte aligned.
    per_thread = (heads + 2) * max_context_len + 2 & ~1
    scratch = library.scratch(threads * per_thread)
    lib.paged_decode_attention(
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        int(kv_cache.dtype == torch.bfloat16),
        block_tables.data_ptr(),
        block_tables.stride(0),
        context_lens.data_ptr(),
        None if rows is None else rows.data_ptr(),
        context_lens.shape[0],
        heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        scratch.data_ptr(),
        per_thread,
        max_context_len,
        threads,
        library.use_pool(num_tokens),
    )
    return True


def _reference(
    query: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, ctx: list[int], scale: float
) -> torch.Tensor:
    heads, head_dim = query.shape[1:]
    kv_heads = kv_cache.shape[3]
    outs = []
    for i, c in enumerate(ctx):
        k = kv_cache[0][tables[i]].reshape(-1, kv_heads, head_dim)[:c].repeat_interleave(heads // kv_heads, 1)
        v = kv_cache[1][tables[i]].reshape(-1, kv_heads, head_dim)[:c].repeat_interleave(heads // kv_heads, 1)
        w = torch.softmax(torch.einsum("hd,thd->ht", query[i], k.float()) * scale, dim=-1)
        outs.append(torch.einsum("ht,thd->hd", w, v.float()).reshape(-1))
    return torch.stack(outs)


def check_paged_decode_attention() -> bool:
    """The kernel against a plain PyTorch attention on a small random cache (GQA, partial last blocks)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 12
    ctx = [1, 5, 8, 11]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:12].view(4, 3).contiguous()
    query = torch.randn(len(ctx), heads, head_dim, generator=gen)
    out = torch.empty(len(ctx), heads * head_dim)
    for kv in (cache, cache.to(torch.bfloat16)):
        done = paged_decode_attention(query, kv, tables, torch.tensor(ctx), max(ctx), None, 0.25, out)
        expected = _reference(query, kv, tables, ctx, 0.25)
        if not (done and torch.allclose(out, expected, rtol=1e-4, atol=1e-5)):
            return False
    return True


library.self_checks.append(check_paged_decode_attention)
