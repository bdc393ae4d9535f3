"""The C decode-attention kernel against the PyTorch (gather + SDPA) path of ``paged_attention``."""

from __future__ import annotations

import pytest
import torch

from app.engine import kernels
from app.engine.attention import SHORT_QUERY_MAX, AttentionMetadata, paged_attention, zeroed_mapping
from app.engine.kernels.attention import (
    bf16_attention_supported,
    check_paged_decode_attention,
    paged_decode_attention,
)

needs_kernel = pytest.mark.skipif(
    not kernels.available(), reason="no C compiler or no AVX2/FMA CPU: the kernel is not built here"
)


def run_step(
    query_lens: list[int],
    context_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int = 64,
    block_size: int = 4,
    use_kernel: bool,
    seed: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """One attention step over a random cache; block tables are shuffled so blocks are not in order."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, head_dim, generator=gen)
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    kernels.enable(use_kernel)
    try:
        out = paged_attention(query, key, value, cache, meta, head_dim**-0.5)
    finally:
        kernels.enable(True)
    return out, meta


@needs_kernel
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "heads", "kv_heads"),
    [
        ([1], [1], 9, 3),  # the first decode token: context of one
        ([1], [203], 9, 3),  # SmolLM2's GQA layout, a partial last block
        ([1] * 20, [1, 2, 3, 5, 8, 60, 61, 63, 4, 9, 7, 62, 6, 3, 2, 64, 1, 59, 5, 58], 4, 2),
        ([1, 7, 1, 5, 1], [33, 7, 2, 12, 17], 8, 8),  # decodes mixed with prefills (one with a cached prefix)
        (
            [4, 1, 5, 4, 12],
            [40, 9, 5, 21, 30],
            9,
            3,
        ),  # speculative verifications, a fresh short prompt, a chunk
    ],
)
def test_kernel_matches_the_torch_path(
    query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, two_threads: None
) -> None:
    ours, meta = run_step(query_lens, context_lens, heads=heads, kv_heads=kv_heads, use_kernel=True)
    ref, _ = run_step(query_lens, context_lens, heads=heads, kv_heads=kv_heads, use_kernel=False)
    assert meta.decode_index is not None
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_short_query_rows_equal_plain_decodes_of_their_positions(two_threads: None) -> None:
    """A verification step (several new tokens of one sequence) gives each token exactly what decoding it
    alone would: one kernel entry per token, which sees its own position and the ones before."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, ctx, new = 9, 3, 64, 4, 42, 5
    table = torch.randperm(16, generator=gen)[: -(-ctx // block_size)].tolist()
    cache = torch.randn(2, 16, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(new, heads, head_dim, generator=gen)
    key = torch.randn(new, kv_heads, head_dim, generator=gen)
    value = torch.randn(new, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    meta = AttentionMetadata.build([new], [ctx], [table], block_size)
    assert meta.prefills[0].block_ids is not None and meta.prefills[0].in_decode_index
    together = paged_attention(query, key, value, cache.clone(), meta, scale)
    # The same tokens as `new` one-token sequences on the same blocks, token t seeing ctx - new + 1 + t keys.
    lens = [ctx - new + 1 + t for t in range(new)]
    alone_meta = AttentionMetadata.build([1] * new, lens, [table] * new, block_size)
    alone = paged_attention(query, key, value, cache.clone(), alone_meta, scale)
    assert torch.equal(together, alone)
    kernels.enable(False)
    try:
        reference = paged_attention(query, key, value, cache.clone(), meta, scale)
    finally:
        kernels.enable(True)
    torch.testing.assert_close(together, reference, rtol=1e-5, atol=2e-6)


def test_long_chunks_stay_on_the_sdpa_path() -> None:
    meta = AttentionMetadata.build([SHORT_QUERY_MAX + 1, 2], [40, 9], [list(range(10)), [10, 11, 12]], 4)
    assert [seq.in_decode_index for seq in meta.prefills] == [False, True]
    assert meta.decode_index is not None and meta.decode_index.context_lens.tolist() == [8, 9]


def test_results_do_not_depend_on_threads_or_runs(two_threads: None) -> None:
    """Each (sequence, kv head) is one task computed start to end by one thread."""
    lens = [40, 3, 77, 12]
    batch, _ = run_step([1] * 4, lens, heads=9, kv_heads=3, use_kernel=True, seed=5)
    again, _ = run_step([1] * 4, lens, heads=9, kv_heads=3, use_kernel=True, seed=5)
    assert torch.equal(batch, again)
    torch.set_num_threads(1)  # the fixture restores the thread count
    single, _ = run_step([1] * 4, lens, heads=9, kv_heads=3, use_kernel=True, seed=5)
    assert torch.equal(batch, single)


@needs_kernel
def test_self_check_passes() -> None:
    assert check_paged_decode_attention()


def test_torch_path_is_used_with_the_kernel_off() -> None:
    out, meta = run_step([1, 1], [5, 9], heads=4, kv_heads=2, use_kernel=False)
    assert out.shape == (2, 4 * 64)
    assert meta.decode_groups  # the SDPA groups were built because the kernel was not used


@needs_kernel
@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not bf16_attention_supported(), reason="needs AVX512-BF16 (the kernel's bfloat16 mode)")),
], ids=["f32", "bf16"])
def test_batch_equals_each_sequence_alone(two_threads: None, dtype: torch.dtype) -> None:
    """A decode over many sequences of mixed lengths (float32, and a bfloat16 model's where the CPU has the
    kernel's bfloat16 mode): each thread claims its next sequence before it runs the current one and fetches that
    one's blocks meanwhile. None of it changes a number: the batch gives each sequence exactly what a call with
    that sequence alone gives (one kv head per task)."""
    bf16 = dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [1, 17, 300, 16, 45, 129, 2, 250, 33, 64, 5, 190]
    need = [-(-c // block_size) for c in lens]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=gen)
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[at : at + n]
        at += n
    cache = zeroed_mapping((2, num_blocks, block_size, kv_heads, head_dim), dtype)
    cache.copy_(torch.randn(cache.shape, generator=gen))
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int64)
    scale = head_dim**-0.5
    batch = torch.empty(len(lens), heads * head_dim, dtype=dtype)
    assert paged_decode_attention(query, cache, tables, ctx, max(lens), None, scale, batch, bf16_values=bf16)
    for i, n in enumerate(lens):
        alone = torch.empty(1, heads * head_dim, dtype=dtype)
        args = (query[i : i + 1], cache, tables[i : i + 1].contiguous(), ctx[i : i + 1], n, None, scale, alone)
        assert paged_decode_attention(*args, bf16_values=bf16)
        assert torch.equal(batch[i], alone[0]), f"sequence {i} (context {n})"


def test_zeroed_mapping_is_zero_on_either_page_size() -> None:
    for huge in (True, False):
        t = zeroed_mapping((3, 1024, 1024), torch.bfloat16, huge_pages=huge)
        assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16
        assert not t.any()
        t[2, 1023, 1023] = 1.0  # writable, private memory
        assert t.sum().item() == 1.0
