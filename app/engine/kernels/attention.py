"""Attention read straight from the paged KV cache: decode by the C kernel ``paged_attention.c``, prefill by
``prefill_attention.c``."""

from __future__ import annotations

import torch

import app.engine.kernels.library as library
from app.engine.kernels.cpu_features import avx512_enabled, cpu_flags, kernel_settings

# Query vectors per tile of the prefill kernel, and its position padding (prefill_attention.c: TILE, PAD).
_PREFILL_TILE, _PREFILL_PAD = 12, 16
# The prefill kernel's builds (its `isa` argument).
PREFILL_ISAS = ("avx2", "avx512", "avx512_bf16", "amx")
AMX_HEAD_DIMS = (32, 64)  # the AMX build's head sizes (prefill_attention_amx.h)


def prefill_isa(bf16_products: bool) -> str:
    """The prefill kernel's build for this CPU: for a bfloat16 model, ``amx`` (AMX-BF16 tiles) where the CPU has
    them, Linux grants them and ``INF_ENGINE_DISABLE_AMX`` is not set, else ``avx512_bf16`` where the CPU has
    AVX512-BF16 and ``INF_ENGINE_DISABLE_BF16`` is not set; else ``avx512`` or ``avx2``."""
    if not avx512_enabled():
        return "avx2"
    if bf16_products and not kernel_settings().disable_bf16 and "avx512_bf16" in cpu_flags():
        return "amx" if amx_enabled() else "avx512_bf16"
    return "avx512"


def amx_enabled() -> bool:
    """AMX-BF16 tiles for the prefill kernel: the CPU has them, the kernels are built, Linux lets this process
    use the tile state, and ``INF_ENGINE_DISABLE_AMX`` is not set."""
    if kernel_settings().disable_amx or not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return False
    lib = library.get()
    return lib is not None and bool(lib.amx_request())


def bf16_attention_supported() -> bool:
    """A bfloat16 model's attention runs on bfloat16 values with bfloat16 products here (AVX512-BF16)."""
    return prefill_isa(bf16_products=True) in ("avx512_bf16", "amx")


def _rows_and_cache_ok(
    query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, dim_multiple: int, max_dim: int
) -> bool:
    """What both attention kernels need of their rows and cache: CPU float32 or bfloat16 query and output of
    the same dtype, heads adjacent, a contiguous float32 or bfloat16 cache, whole GQA groups."""
    heads, head_dim = query.shape[1], query.shape[2]
    return (
        query.dtype in (torch.float32, torch.bfloat16)
        and kv_cache.dtype in (torch.float32, torch.bfloat16)
        and out.dtype == query.dtype
        and query.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and head_dim % dim_multiple == 0
        and head_dim <= max_dim
        and heads % kv_cache.shape[3] == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and kv_cache.is_contiguous()
        and out.shape == (query.shape[0], heads * head_dim)
    )


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    rows: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    *,
    bf16_values: bool = False,
) -> bool:
    """Attention of one query token per sequence over its cached context; False when it does not apply.

    ``query`` is ``[T, heads, head_dim]`` (the new K/V already written to the cache), ``kv_cache`` one layer's
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` (float32 or bfloat16), ``block_tables`` ``[seqs, width]`` int64 (every entry a
    valid block id), ``context_lens`` ``[seqs]`` int64, ``rows`` the query row of each sequence (None: row i is
    sequence i). Writes those rows of ``out`` ``[T, heads * head_dim]``.

    ``query`` and ``out`` may both be bfloat16 with ``bf16_values`` on a bfloat16 cache with AVX512-BF16 (the
    rows of a bfloat16 model that stay in bfloat16 between its products): the same numbers, the output rounded.

    ``bf16_values`` (a bfloat16 model): the query, keys and values are rounded to bfloat16, the softmax weights
    and every sum stay float32, as in :func:`paged_prefill_attention` with ``bf16_products``, so that a position
    decoded here stays within float32 rounding of the same position prefilled there. On a bfloat16 cache with
    AVX512-BF16, the scores are bfloat16 products.
    """
    lib = library.get()
    if lib is None:
        return False
    num_tokens, heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    io_bf16 = query.dtype == torch.bfloat16  # a bfloat16 model's rows, kept in bfloat16 (mode 2 only)
    if (
        not _rows_and_cache_ok(query, kv_cache, out, 8, 128)
        or (io_bf16 and not bf16_values)
        or heads > 256
        or not out.is_contiguous()
        or not block_tables.is_contiguous()
        or block_tables.dtype != torch.int64
        or context_lens.dtype != torch.int64
        or not context_lens.is_contiguous()
        or (rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()))
    ):
        return False
    mode = 0
    if bf16_values:
        dots = kv_cache.dtype == torch.bfloat16 and head_dim % 32 == 0 and bf16_attention_supported()
        mode = 2 if dots else 1  # 2: AVX512-BF16 products on the bfloat16 cache; 1: the same values, AVX2
        if not dots:
            if io_bf16:
                return False
            query = query.to(torch.bfloat16).float()  # a copy: the rows the caller keeps are not rounded
    threads = torch.get_num_threads()
    # Scores, then int64 cache-row indices (then a task's query and output rows in float32, for bfloat16 ones);
    # even, so every thread's part stays 8-byte aligned.
    per_thread = ((heads + 2) * max_context_len + (2 * heads * head_dim if io_bf16 else 0) + 2) & ~1
    scratch = library.scratch(threads * per_thread)
    lib.paged_decode_attention(
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        int(kv_cache.dtype == torch.bfloat16),
        mode,
        int(io_bf16),
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


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: list[int],
    query_starts: list[int],
    query_lens: list[int],
    scale: float,
    out: torch.Tensor,
    *,
    bf16_products: bool = False,
    isa: str | None = None,
) -> bool:
    """Causal attention of multi-token sequences over their cached context; False when it does not apply.

    Sequence ``s`` has ``query_lens[s]`` query rows from row ``query_starts[s]`` of ``query`` ``[T, heads,
    head_dim]`` (float32, CPU): the last of its ``context_lens[s]`` positions, whose K/V (the new ones too)
    are already in ``kv_cache`` (one layer's ``[2, num_blocks, block_size, kv_heads, head_dim]``, float32 or
    bfloat16) through row ``s`` of ``tables`` (``[seqs, width]`` int64). Writes those rows of ``out`` ``[T,
    heads * head_dim]``. A query row's numbers depend only on its own query and context, never on the other rows
    of the call, so a prompt gives the same bits whole, in chunks, or after a prefix-cache hit.

    ``query`` and ``out`` may both be bfloat16 for the AMX build (a bfloat16 model's rows kept in bfloat16
    between its products: the same numbers, the output rounded); False for the other builds.

    ``bf16_products``: a bfloat16 model's precision, where the CPU has it: queries, keys and values rounded to
    bfloat16 (as a bfloat16 SDPA has them), the scores by bfloat16 products, float32 weights and sums. ``isa`` forces a build of
    :data:`PREFILL_ISAS` (None: :func:`prefill_isa`).
    """
    lib = library.get()
    if lib is None:
        return False
    heads, head_dim = query.shape[1], query.shape[2]
    _, _, block_size, kv_heads, _ = kv_cache.shape
    io_bf16 = query.dtype == torch.bfloat16  # the AMX and AVX512-BF16 builds only: see below
    if (
        not _rows_and_cache_ok(query, kv_cache, out, 16, 256)
        or out.stride(1) != 1
        or not tables.is_contiguous()
        or tables.dtype != torch.int64
        or tables.shape[0] != len(context_lens)
    ):
        return False
    padded = [-(-c // _PREFILL_PAD) * _PREFILL_PAD for c in context_lens]
    threads = torch.get_num_threads()
    build = prefill_isa(bf16_products) if isa is None else isa
    if build == "amx" and head_dim not in AMX_HEAD_DIMS:
        build = "avx512_bf16"  # the same values, without tiles
    if io_bf16 and build not in ("amx", "avx512_bf16"):
        return False
    per_thread = _PREFILL_TILE * max(padded) + head_dim
    if build == "amx":  # scores, three bfloat16 parts of the weights, the tile's sums (prefill_attention.c)
        per_thread = _PREFILL_TILE * (-(-max(padded) // 32) * 32 * 5 // 2 + 64) + head_dim
    kv_numel = sum(padded) * kv_heads * 2 * head_dim  # the gathered K/V, then each thread's scores
    scratch = library.scratch(kv_numel + threads * per_thread)  # reused: no page faults per layer
    meta = torch.tensor([context_lens, query_starts, query_lens], dtype=torch.int64)
    status = lib.paged_prefill_attention(
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        int(kv_cache.dtype == torch.bfloat16),
        int(io_bf16),
        tables.data_ptr(),
        tables.stride(0),
        meta[0].data_ptr(),
        meta[1].data_ptr(),
        meta[2].data_ptr(),
        len(context_lens),
        heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        scratch.data_ptr(),
        scratch.data_ptr() + 4 * kv_numel,
        per_thread,
        PREFILL_ISAS.index(build),
        threads,
        library.use_pool(query.shape[0]),
    )
    if status != 0:
        raise MemoryError("the prefill attention kernel could not allocate its task table")
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
