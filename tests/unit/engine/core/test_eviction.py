"""Eviction policies of the prefix cache: the policies alone, then through the block manager (which block is
given up under each policy, time-to-live with an injected clock, counters)."""

from __future__ import annotations

import pytest

from app.engine.core.block_manager import BlockManager
from app.engine.core.eviction import (
    EVICTION_POLICIES,
    ExpiryClock,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    check_eviction_policy,
    check_ttl,
    make_eviction_policy,
)
from app.engine.core.sequence import Sequence

# ---- the policies alone ----


def drain(policy: LRUPolicy | LFUPolicy | FIFOPolicy) -> list[int]:
    out = []
    while len(policy):
        out.append(policy.pop())
    return out


def test_lru_evicts_the_block_freed_longest_ago() -> None:
    p = LRUPolicy()
    for b in (3, 1, 2):
        p.push(b)
    p.remove(3)  # revived by a hit...
    p.push(3)  # ...and freed again: now the most recent
    assert 1 in p and len(p) == 3
    assert drain(p) == [1, 2, 3]
    with pytest.raises(KeyError):
        p.pop()


def test_lfu_evicts_the_least_used_block_ties_by_recency() -> None:
    p = LFUPolicy()
    for b in (1, 2, 3, 4):
        p.on_cached(b)
    p.on_hit(3)
    p.on_hit(3)
    p.on_hit(1)
    for b in (3, 1, 4, 2):
        p.push(b)
    # uses: 1 -> 2, 2 -> 1, 3 -> 3, 4 -> 1; among 4 and 2, block 4 was freed first.
    assert drain(p) == [4, 2, 1, 3]


def test_lfu_forgets_uses_when_contents_are_dropped() -> None:
    p = LFUPolicy()
    p.on_cached(1)
    p.on_hit(1)
    p.on_dropped(1)
    p.on_cached(1)  # new contents start from one use
    p.on_cached(2)
    p.push(2)
    p.push(1)
    assert drain(p) == [2, 1]


def test_fifo_evicts_the_block_cached_first_however_often_hit() -> None:
    p = FIFOPolicy()
    for b in (5, 6, 7):
        p.on_cached(b)
    for _ in range(10):
        p.on_hit(5)
    for b in (7, 6, 5):
        p.push(b)
    assert drain(p) == [5, 6, 7]


def test_heap_policies_skip_removed_entries_and_stay_small() -> None:
    p = LFUPolicy()
    for b in range(4):
        p.on_cached(b)
        p.push(b)
    for _ in range(1000):  # hits revive and free again: stale entries must not pile up
        p.remove(2)
        p.on_hit(2)
        p.push(2)
    assert len(p._heap) <= 2 * len(p) + 17
    p.remove(0)
    assert 0 not in p and set(p) == {1, 2, 3}
    assert drain(p) == [1, 3, 2]


def test_policy_names_and_validation() -> None:
    assert EVICTION_POLICIES == ("lru", "lfu", "fifo")
    assert [make_eviction_policy(n).name for n in EVICTION_POLICIES] == list(EVICTION_POLICIES)
    with pytest.raises(ValueError, match=r"kv_cache_eviction_policy must be one of 'lru', 'lfu', 'fifo'"):
        check_eviction_policy("arc")
    with pytest.raises(ValueError, match="prefix_cache_ttl_s must be a positive number"):
        check_ttl(0)
    with pytest.raises(ValueError, match="prefix_cache_ttl_s"):
        check_ttl(float("nan"))
    with pytest.raises(ValueError, match="kv_cache_eviction_policy"):
        BlockManager(4, 4, eviction_policy="random")
    with pytest.raises(ValueError, match="prefix_cache_ttl_s"):
        BlockManager(4, 4, prefix_cache_ttl_s=-1.0)


def test_expiry_clock_expires_oldest_first() -> None:
    now = [0.0]
    clock = ExpiryClock(10.0, lambda: now[0])
    clock.freed(1)
    now[0] = 4.0
    clock.freed(2)
    clock.freed(3)
    clock.forget(3)
    now[0] = 9.9
    assert clock.expired() == []
    now[0] = 10.0
    assert clock.expired() == [1]
    now[0] = 100.0
    assert clock.expired() == [2]


# ---- through the block manager ----


def prefill(bm: BlockManager, tokens: list[int], rid: str) -> Sequence:
    """Admit a sequence (with prefix lookup), pretend it was computed, register its full blocks."""
    seq = Sequence(rid, tokens)
    hits = bm.find_cached_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * bm.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def cached_prefixes(bm: BlockManager) -> set[str]:
    probes = {"A": A, "B": B, "C": C}
    return {name for name, block in probes.items() if bm.find_cached_blocks(Sequence("probe", [*block, 0]))}


@pytest.mark.parametrize(
    ("policy", "evicted"),
    [("lru", ["B", "A"]), ("lfu", ["B", "C"]), ("fifo", ["A", "B"])],
)
def test_which_cached_prefix_each_policy_gives_up(policy: str, evicted: list[str]) -> None:
    # 4 blocks of 4 tokens; each request is one full (cached) block and one partial block.
    bm = BlockManager(num_blocks=4, block_size=4, eviction_policy=policy)
    assert bm.eviction_policy == policy
    for name, tokens in (("a", A), ("b", B), ("a2", A), ("c", C)):  # A is cached, then hit once
        bm.free(prefill(bm, [*tokens, 99], name))
    assert bm.prefix_cache_hits == 4 and bm.num_cached_blocks == 3 and bm.num_free_blocks == 4
    # A fresh request takes the one empty block, then each block it grows by evicts one cached prefix.
    filler = Sequence("filler", list(range(100, 112)))
    assert bm.allocate_slots(filler, 4) and bm.num_evictions == 0
    survivors = {"A", "B", "C"}
    for i, name in enumerate(evicted, start=1):
        filler.num_computed_tokens += 4
        assert bm.allocate_slots(filler, 4)
        survivors.discard(name)
        assert cached_prefixes(bm) == survivors, f"eviction {i}"
        assert bm.num_evictions == i and bm.num_cached_blocks == len(survivors)


def test_lru_frees_a_prefix_tail_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = prefill(bm, [*A, *B, 99], "a")  # two cached blocks, A then its child
    parent, child = seq.block_table[:2]
    bm.free(seq)
    other = Sequence("o", list(range(100, 108)))
    assert bm.allocate_slots(other, 8)  # the empty block, then one eviction: the child
    assert bm.blocks[parent].block_hash is not None and bm.blocks[child].block_hash is None


def test_ttl_drops_prefixes_left_unused_with_an_injected_clock() -> None:
    now = [0.0]
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache_ttl_s=10.0, clock=lambda: now[0])
    bm.free(prefill(bm, [*A, 99], "a"))
    now[0] = 9.0
    hit = prefill(bm, [*A, 98], "hit")
    assert hit.num_cached_tokens == 4
    bm.free(hit)  # the clock restarts when its last user frees it
    now[0] = 18.0
    assert cached_prefixes(bm) == {"A"} and bm.num_expirations == 0
    now[0] = 19.0
    assert cached_prefixes(bm) == set() and bm.num_expirations == 1
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8 and bm.num_evictions == 0


def test_ttl_never_expires_a_block_in_use() -> None:
    now = [0.0]
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache_ttl_s=1.0, clock=lambda: now[0])
    holder = prefill(bm, [*A, 99], "holder")
    now[0] = 100.0
    late = prefill(bm, [*A, 98], "late")
    assert late.num_cached_tokens == 4 and bm.num_expirations == 0
    bm.free(holder)
    bm.free(late)
    now[0] = 100.5
    assert cached_prefixes(bm) == {"A"}
    now[0] = 101.0
    assert cached_prefixes(bm) == set() and bm.num_expirations == 1


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_reset_and_reuse_keep_the_pools_consistent(policy: str) -> None:
    bm = BlockManager(num_blocks=6, block_size=4, eviction_policy=policy, prefix_cache_ttl_s=5.0)
    for rid, tokens in (("a", A), ("b", B)):
        bm.free(prefill(bm, [*tokens, 99], rid))
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 6 and cached_prefixes(bm) == set()
    big = Sequence("big", list(range(100, 124)))
    assert bm.allocate_slots(big, 24) and bm.num_free_blocks == 0 and bm.num_evictions == 0
