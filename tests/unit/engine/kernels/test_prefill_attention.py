"""The C prefill-attention kernel: against a float64 reference, in both builds (AVX-512 and AVX2), and exact
whatever way a prompt is split (whole, in chunks, after a prefix-cache hit, batched with others)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from app.engine import kernels
from app.engine.attention import AttentionMetadata, paged_attention, use_prefill_kernel
from app.engine.kernels.attention import (
    amx_enabled,
    avx512_enabled,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_isa,
)
from app.engine.kernels.cpu_features import cpu_flags

needs_kernel = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler or no AVX2/FMA CPU: the kernel is not built here"
)
BUILDS = [
    pytest.param("avx2", id="avx2"),
    pytest.param(
        "avx512",
        id="avx512",
        marks=pytest.mark.skipif("avx512f" not in cpu_flags(), reason="this CPU has no AVX-512F"),
    ),
    pytest.param(
        "avx512_bf16",
        id="avx512_bf16",
        marks=pytest.mark.skipif(
            not {"avx512f", "avx512_bf16"} <= cpu_flags(), reason="this CPU has no AVX512-BF16"
        ),
    ),
    pytest.param(
        "amx",
        id="amx",
        marks=pytest.mark.skipif(not amx_enabled(), reason="this CPU (or its kernel) gives no AMX-BF16 tiles"),
    ),
]
BF16_BUILDS = ("avx512_bf16", "amx")
SHAPES = [(9, 3, 64), (4, 4, 16), (8, 1, 32), (6, 2, 48)]  # (heads, kv_heads, head_dim): GQA, MHA, MQA


def random_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)


def reference(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, ctx: int, scale: float, bf16: bool = False
) -> torch.Tensor:
    """float64 causal attention of the last ``len(q)`` of ``ctx`` positions (of q, k, v rounded to bfloat16
    first with ``bf16``)."""
    qlen, heads, head_dim = q.shape
    kvh = cache.shape[3]
    if bf16:
        q, cache = q.bfloat16(), cache.bfloat16()
    k = cache[0][table].reshape(-1, kvh, head_dim)[:ctx].double().repeat_interleave(heads // kvh, 1)
    v = cache[1][table].reshape(-1, kvh, head_dim)[:ctx].double().repeat_interleave(heads // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(ctx - qlen, ctx)
    scores = scores.masked_fill(torch.arange(ctx)[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(qlen, -1).float()


@needs_kernel
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_kernel_matches_float64_reference(
    isa: str, cache_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, two_threads: None
) -> None:
    block_size, num_blocks = 16, 80
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:40] for _ in range(3)]).contiguous()
    ctxs, qlens, starts = [37, 300, 5], [37, 100, 2], [0, 37, 137]  # a whole prompt, a chunk, a tiny one
    query = torch.randn(sum(qlens), heads, head_dim, generator=gen)
    out = torch.full((sum(qlens), heads * head_dim), float("nan"))
    assert paged_prefill_attention(query, cache, tables, ctxs, starts, qlens, 0.125, out, isa=isa)
    for i, (start, qlen) in enumerate(zip(starts, qlens, strict=True)):
        rows = slice(start, start + qlen)
        bf16 = isa in BF16_BUILDS
        expected = reference(query[rows], cache, tables[i], ctxs[i], 0.125, bf16)
        # the bfloat16 build is held as tight: the reference rounds q, k and v as its products do
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=3e-6)


@needs_kernel
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_row_gets_the_same_bits_however_the_prompt_is_split(
    isa: str, cache_dtype: torch.dtype, two_threads: None
) -> None:
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    cache = random_cache(40, block_size, kv_heads, head_dim, cache_dtype, seed=3)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(4))[:20].view(1, 20).contiguous()
    query = torch.randn(300, heads, head_dim, generator=torch.Generator().manual_seed(5))
    whole = torch.empty(300, heads * head_dim)
    assert paged_prefill_attention(query, cache, table, [300], [0], [300], 0.1, whole, isa=isa)
    for cut in (1, 7, 150, 299):  # a prefix of `cut` positions cached, the rest one chunk
        part = torch.empty(300 - cut, heads * head_dim)
        assert paged_prefill_attention(query[cut:], cache, table, [300], [0], [300 - cut], 0.1, part, isa=isa)
        assert torch.equal(part, whole[cut:]), cut
    # Batched with other sequences (a chunk of the same prompt among them) changes nothing either.
    tables = torch.cat([table, table.flip(1), table]).contiguous()
    batch_q = torch.cat([query[:90], query[:40], query[250:]])
    batch = torch.empty(len(batch_q), heads * head_dim)
    assert paged_prefill_attention(
        batch_q, cache, tables, [90, 40, 300], [0, 90, 130], [90, 40, 50], 0.1, batch, isa=isa
    )
    assert torch.equal(batch[:90], whole[:90])
    assert torch.equal(batch[130:], whole[250:])


@needs_kernel
def test_paged_attention_is_exact_across_a_prefix_cache_hit(two_threads: None) -> None:
    """Through ``paged_attention``: a prompt's last rows computed after its prefix was cached equal the
    rows of the whole prompt computed at once, bit for bit, and stay close to PyTorch's SDPA path."""
    heads, kv_heads, head_dim, block_size, ctx, cached = 9, 3, 64, 16, 200, 128
    gen = torch.Generator().manual_seed(6)
    table = torch.randperm(20, generator=gen)[: ctx // block_size + 1].tolist()
    query = torch.randn(ctx, heads, head_dim, generator=gen)
    key = torch.randn(ctx, kv_heads, head_dim, generator=gen)
    value = torch.randn(ctx, kv_heads, head_dim, generator=gen)
    cache = torch.zeros(2, 20, block_size, kv_heads, head_dim)
    whole = paged_attention(
        query, key, value, cache, AttentionMetadata.build([ctx], [ctx], [table], block_size), 0.125
    )
    hit = AttentionMetadata.build([ctx - cached], [ctx], [table], block_size)  # the prefix is in `cache`
    suffix = paged_attention(query[cached:], key[cached:], value[cached:], cache, hit, 0.125)
    assert torch.equal(suffix, whole[cached:])
    use_prefill_kernel(False)
    try:
        sdpa = paged_attention(
            query, key, value, cache, AttentionMetadata.build([ctx], [ctx], [table], block_size), 0.125
        )
    finally:
        use_prefill_kernel(True)
    torch.testing.assert_close(whole, sdpa, rtol=1e-5, atol=3e-6)


@needs_kernel
def test_declines_what_it_cannot_run() -> None:
    """Declined inputs fall back to PyTorch (the caller checks the answer): bfloat16 queries, a head size
    that is not a multiple of 16."""
    cache = random_cache(4, 4, 1, 16, torch.float32, seed=7)
    table = torch.arange(4).view(1, 4)
    out = torch.empty(3, 16)
    q = torch.randn(3, 1, 16)
    assert not paged_prefill_attention(q.bfloat16(), cache, table, [10], [0], [3], 0.25, out)
    odd = random_cache(4, 4, 1, 8, torch.float32, seed=7)
    assert not paged_prefill_attention(torch.randn(3, 1, 8), odd, table, [10], [0], [3], 0.25, out[:, :8])


def test_avx512_switch(settings_env: Callable[[str, str | None], None]) -> None:
    settings_env("INF_ENGINE_DISABLE_AVX512", "1")
    assert not avx512_enabled()
    settings_env("INF_ENGINE_DISABLE_AVX512", None)
    assert avx512_enabled() == ({"avx512f", "avx512dq", "avx512bw"} <= cpu_flags())


def test_bf16_and_amx_switches(settings_env: Callable[[str, str | None], None]) -> None:
    settings_env("INF_ENGINE_DISABLE_BF16", "true")
    assert prefill_isa(bf16_products=True) in ("avx2", "avx512")
    settings_env("INF_ENGINE_DISABLE_BF16", None)
    settings_env("INF_ENGINE_DISABLE_AMX", "1")
    assert not amx_enabled() and prefill_isa(bf16_products=True) != "amx"


@needs_kernel
@pytest.mark.parametrize("isa", [b for b in BUILDS if b.values[0] in BF16_BUILDS])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bf16_decode_agrees_with_bf16_prefill(cache_dtype: torch.dtype, isa: str, two_threads: None) -> None:
    """A bfloat16 model decodes a position as its prefill computes it, within float32 rounding: both use
    bfloat16 values and float32 sums (a prefix-cache hit that leaves a few tokens to the decode kernel sees
    what the whole prompt saw). Without rounding, the decode kernel is ~1e-3 away."""
    heads, kv_heads, head_dim, block_size, ctx = 9, 3, 64, 16, 100
    cache = random_cache(10, block_size, kv_heads, head_dim, cache_dtype, seed=8)
    table = torch.randperm(10, generator=torch.Generator().manual_seed(9))[:7].view(1, 7).contiguous()
    query = torch.randn(ctx, heads, head_dim, generator=torch.Generator().manual_seed(10))
    prefill = torch.empty(ctx, heads * head_dim)
    assert paged_prefill_attention(query, cache, table, [ctx], [0], [ctx], 0.125, prefill, isa=isa)
    tables = table.expand(ctx, 7).contiguous()
    lens = torch.arange(1, ctx + 1)
    rounded, plain = torch.empty_like(prefill), torch.empty_like(prefill)
    assert paged_decode_attention(query, cache, tables, lens, ctx, None, 0.125, rounded, bf16_values=True)
    assert paged_decode_attention(query, cache, tables, lens, ctx, None, 0.125, plain)
    torch.testing.assert_close(rounded, prefill, rtol=1e-5, atol=2e-6)
    assert (plain - prefill).abs().max() > 1e-4


@needs_kernel
@pytest.mark.parametrize("isa", [b for b in BUILDS if b.values[0] in BF16_BUILDS])
def test_bf16_rows_in_and_out_give_the_float32_rows_numbers_rounded(isa: str, two_threads: None) -> None:
    """A bfloat16 model keeps q and the attention output in bfloat16 between its products: the prefill (AMX or
    AVX512-BF16 build) and the AVX512-BF16 decode read the bfloat16 query and round their output, the same
    numbers otherwise. A mixed step then needs no float32 copies of its rows."""
    heads, kv_heads, head_dim, block_size, ctx = 9, 3, 64, 16, 70
    cache = random_cache(8, block_size, kv_heads, head_dim, torch.bfloat16, seed=11)
    table = torch.randperm(8, generator=torch.Generator().manual_seed(12))[:5].view(1, 5).contiguous()
    query = torch.randn(ctx, heads, head_dim, generator=torch.Generator().manual_seed(13)).bfloat16()
    wide = torch.empty(ctx, heads * head_dim)
    rows = torch.empty(ctx, heads * head_dim, dtype=torch.bfloat16)
    assert paged_prefill_attention(query.float(), cache, table, [ctx], [0], [ctx], 0.125, wide, isa=isa)
    assert paged_prefill_attention(query, cache, table, [ctx], [0], [ctx], 0.125, rows, isa=isa)
    assert torch.equal(rows, wide.bfloat16())
    assert not paged_prefill_attention(query, cache, table, [ctx], [0], [ctx], 0.125, rows, isa="avx512")
    tables = table.expand(ctx, 5).contiguous()
    lens = torch.arange(1, ctx + 1)
    wide_dec = torch.empty(ctx, heads * head_dim)
    rows_dec = torch.empty(ctx, heads * head_dim, dtype=torch.bfloat16)
    assert paged_decode_attention(query.float(), cache, tables, lens, ctx, None, 0.125, wide_dec, bf16_values=True)
    assert paged_decode_attention(query, cache, tables, lens, ctx, None, 0.125, rows_dec, bf16_values=True)
    assert torch.equal(rows_dec, wide_dec.bfloat16())
    assert not paged_decode_attention(query, cache, tables, lens, ctx, None, 0.125, rows_dec)  # needs bf16 values
