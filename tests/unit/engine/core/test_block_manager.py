import pytest

from app.engine.core.block_manager import (
    BlockManager,
    hash_block,
    kv_cache_bytes_per_block,
    num_blocks_for_budget,
    slot_mapping,
)
from app.engine.core.sequence import Sequence


def make_seq(tokens: list[int] | int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(1, tokens + 1)) if isinstance(tokens, int) else tokens)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` (with prefix lookup), pretend its pending tokens were computed, register its blocks."""
    hits = bm.find_cached_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * bm.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_allocate_and_free_ref_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(10)
    assert bm.can_allocate(seq, 10)
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert bm.num_free_blocks == 5
    assert bm.kv_cache_usage_perc == pytest.approx(3 / 8)
    # Growing within the last block needs nothing new; crossing a boundary needs one block.
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2) and len(seq.block_table) == 3
    assert bm.allocate_slots(seq, 3) and len(seq.block_table) == 4
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert refs(bm) == [0] * 8 and bm.num_free_blocks == 8 and bm.kv_cache_usage_perc == 0.0


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(9)
    assert not bm.can_allocate(seq, 9)
    assert not bm.allocate_slots(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate_slots(seq, 8)


def test_chained_hashes() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    # Same block contents behind a different prefix hash differently.
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])

    bm = BlockManager(num_blocks=16, block_size=4)
    s1, s2, s3 = (
        make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        make_seq([1, 2, 3, 4, 5, 6, 7, 8]),
        make_seq([9, 2, 3, 4, 5, 6, 7, 8]),
    )
    for s in (s1, s2, s3):
        prefill(bm, s)
    assert len(s1.block_hashes) == 2  # only full blocks are hashed
    assert s1.block_hashes == s2.block_hashes
    assert s3.block_hashes[0] != s1.block_hashes[0] and s3.block_hashes[1] != s1.block_hashes[1]


def test_prefix_hit_on_second_request() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    prefill(bm, first)
    assert bm.num_cached_blocks == 2
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)

    second = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44], "b")
    hits = bm.find_cached_blocks(second)
    assert hits == first.block_table[:2]
    assert bm.allocate_slots(second, 3, hits)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2] and len(second.block_table) == 3
    assert [bm.blocks[b].ref_count for b in hits] == [2, 2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)

    bm.free(first)
    assert [bm.blocks[b].ref_count for b in hits] == [1, 1]
    bm.free(second)
    assert refs(bm) == [0] * 16 and bm.num_cached_blocks == 2  # contents stay cached while free


def test_whole_prompt_is_never_a_hit() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefill(bm, make_seq(8, "a"))
    again = make_seq(8, "b")
    hits = bm.find_cached_blocks(again)
    assert len(hits) == 1  # the block with the last token is recomputed, so the step yields logits
    assert bm.allocate_slots(again, 4, hits) and again.num_computed_tokens == 4


def test_free_cached_blocks_are_revived() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_seq(9, "a")
    prefill(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 4 and bm.kv_cache_usage_perc == 0.0
    second = make_seq(list(range(1, 9)) + [77, 78], "b")
    hits = bm.find_cached_blocks(second)
    assert hits == cached
    # 2 revived + 1 fresh of 4 blocks; the revived ones must not be handed out again as fresh.
    assert bm.can_allocate(second, 2, hits)
    assert not bm.can_allocate(second, 2 + 2 * 4, hits)
    assert bm.allocate_slots(second, 2, hits)
    assert second.block_table[:2] == cached and second.block_table[2] not in cached
    assert bm.num_free_blocks == 1


def test_lru_eviction_of_cached_free_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 3], "a"), make_seq([4, 5, 6], "b")
    prefill(bm, a)
    prefill(bm, b)
    assert bm.num_cached_blocks == 2
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    # A fresh 6-token sequence needs 3 blocks: the 2 uncached ones go first, then a's cached block.
    c = make_seq([9, 9, 9, 9, 9, 9], "c")
    assert bm.allocate_slots(c, 6, bm.find_cached_blocks(c))
    assert bm.num_cached_blocks == 1
    assert bm.find_cached_blocks(make_seq([1, 2, 3])) == []
    assert len(bm.find_cached_blocks(make_seq([4, 5, 6]))) == 1


def test_revived_block_moves_to_the_back_of_the_lru() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = make_seq([1, 2, 3], "a"), make_seq([4, 5, 6], "b")
    prefill(bm, a)
    a_block = a.block_table[0]
    bm.free(a)
    prefill(bm, b)
    bm.free(b)
    again = make_seq([1, 2, 3], "a2")  # hits a's block, making it the most recently used
    prefill(bm, again)
    assert again.block_table[0] == a_block
    bm.free(again)
    big = make_seq([7, 7, 7, 7], "big")  # 2 fresh blocks: the uncached one, then b's (older than a's)
    assert bm.allocate_slots(big, 4, [])
    assert bm.find_cached_blocks(make_seq([4, 5, 6])) == []
    assert bm.find_cached_blocks(make_seq([1, 2, 3])) == [a_block]


def test_equal_blocks_prefilled_together_register_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    x, y = make_seq(6, "x"), make_seq(6, "y")
    for s in (x, y):  # both admitted before either is computed: no hits
        assert bm.allocate_slots(s, 6, bm.find_cached_blocks(s))
    for s in (x, y):
        s.num_computed_tokens = 6
        bm.cache_full_blocks(s)
    assert bm.num_cached_blocks == 1
    assert bm.blocks[x.block_table[0]].block_hash is not None
    assert bm.blocks[y.block_table[0]].block_hash is None


def test_fork_shares_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(10, "r")
    prefill(bm, parent)
    child = parent.spawn(1)
    assert bm.fork(parent, child) == 8
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert bm.allocate_slots(child, 2)  # its own last block: no copy-on-write needed
    assert child.block_table[2] != parent.block_table[2]
    bm.free(parent)
    assert [bm.blocks[b].ref_count for b in child.block_table] == [1, 1, 1]
    bm.free(child)
    assert refs(bm) == [0] * 8

    # A prompt that fills its blocks exactly keeps its last block for the child to compute.
    p2 = make_seq(8, "s")
    prefill(bm, p2)
    assert bm.fork(p2, p2.spawn(1)) == 4
    with pytest.raises(ValueError, match="does not share a prefix"):
        bm.fork(p2, make_seq([5] * 8, "other"))


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(bm, make_seq(10, "a"))
    assert bm.find_cached_blocks(make_seq(10, "b")) == []
    assert bm.num_cached_blocks == 0 and (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


def test_reset_prefix_cache_keeps_blocks_in_use() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(9, "a"), make_seq([5] * 9, "b")
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2  # b's
    assert bm.find_cached_blocks(make_seq(9)) == []


def test_memory_budget_to_num_blocks() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32, 16-token blocks.
    per_block = kv_cache_bytes_per_block(
        num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=16
    )
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    dims = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "block_size": 16}
    assert num_blocks_for_budget(1 << 30, **dims) == (1 << 30) // 737_280
    assert num_blocks_for_budget(737_280, **dims) == 1
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(1000, **dims)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        num_blocks_for_budget(1 << 30, **{**dims, "head_dim": 0})


def test_slot_mapping() -> None:
    assert slot_mapping([3, 1], 4, 0, 8) == [12, 13, 14, 15, 4, 5, 6, 7]
    assert slot_mapping([3, 1], 4, 5, 6) == [5]
    with pytest.raises(ValueError, match="outside a table of 2 blocks"):
        slot_mapping([3, 1], 4, 0, 9)
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(6)
    bm.allocate_slots(seq, 6)
    assert bm.slot_mapping(seq, 4, 6) == [seq.block_table[1] * 4, seq.block_table[1] * 4 + 1]


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="at least one token"):
        Sequence("r", [])
