"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, and prefix caching by chained block hashes.

Only block ids live here; the tensors are owned by the model runner. A block that holds a full, computed
block of tokens is registered under the hash of (parent block's hash, its token ids), so the hash names the
whole prefix up to and including that block. When its last user frees it, the block keeps its contents
and its hash and becomes evictable; a later request with the same prefix revives it, and only when a fresh
block is needed and no empty one is left does the eviction policy (:mod:`app.engine.core.eviction`: ``lru``,
``lfu`` or ``fifo``) pick one to give up. With a time-to-live, cached blocks left unused that long are
dropped at the next lookup.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from app.engine.core.eviction import ExpiryClock, make_eviction_policy
from app.engine.core.sequence import BlockHash, Sequence


def hash_block(parent: BlockHash | None, token_ids: Seq[int]) -> BlockHash:
    """Chained hash of a full block. A cryptographic digest, so a collision cannot silently serve
    another prompt's KV."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def kv_cache_bytes_per_block(
    *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int
) -> int:
    """Bytes of K and V for one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(
    budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int
) -> int:
    """How many blocks fit in a memory budget; a ValueError if not even one does."""
    dims = {
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
        "block_size": block_size,
    }
    for name, value in dims.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    per_block = kv_cache_bytes_per_block(**dims)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV-cache budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
            f"needs {per_block} bytes"
        )
    return num_blocks


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Physical cache slots of token positions [start, end)."""
    if start < 0 or end > len(block_table) * block_size:
        raise ValueError(f"positions [{start}, {end}) are outside a table of {len(block_table)} blocks")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        eviction_policy: str = "lru",
        prefix_cache_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks without cached contents, front = used first; a freed one goes to the front. They are
        # always used before any evictable (free, cached) block, which the policy orders.
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evictable = make_eviction_policy(eviction_policy)
        self._expiry = ExpiryClock(prefix_cache_ttl_s, clock) if prefix_cache_ttl_s is not None else None
        self._cached: dict[BlockHash, int] = {}  # hash -> block id
        self._num_registered: dict[int, int] = {}  # seq id -> leading blocks already checked for hashing
        self.prefix_cache_queries = 0  # tokens looked up, counted like vLLM
        self.prefix_cache_hits = 0  # of which served from the cache
        self.num_evictions = 0  # cached blocks given up for fresh ones
        self.num_expirations = 0  # cached blocks dropped by the time-to-live

    # ---- stats ----
    @property
    def eviction_policy(self) -> str:
        return self._evictable.name

    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def kv_cache_usage_perc(self) -> float:
        """Fraction of blocks referenced by live sequences (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache ----
    def _update_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else seq.cache_salt
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks matching the longest prefix of ``seq``, leaving at least its last token
        to compute so that the step yields logits. Takes no references."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        self.expire()
        self._update_hashes(seq)
        hits: list[int] = []
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has completely computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq)
        start = self._num_registered.get(seq.seq_id, 0)
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            # If an identical block is already registered (two equal prompts prefilled together),
            # this copy stays unhashed and is recycled first once freed.
            if block.block_hash is None and seq.block_hashes[i] not in self._cached:
                block.block_hash = seq.block_hashes[i]
                self._cached[block.block_hash] = block.block_id
                self._evictable.on_cached(block.block_id)
        self._num_registered[seq.seq_id] = max(start, end)

    def reset_prefix_cache(self) -> None:
        """Forget cached contents of free blocks (blocks in use keep theirs)."""
        for block_id in list(self._evictable):
            self._drop(block_id)
            self._empty[block_id] = None

    def expire(self) -> None:
        """Drop the cached contents of free blocks unused for the time-to-live (none without one)."""
        if self._expiry is None:
            return
        for block_id in self._expiry.expired():
            self._drop(block_id)
            self._empty[block_id] = None
            self.num_expirations += 1

    # ---- allocation ----
    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int) -> int:
        computed = seq.num_computed_tokens + num_computed_blocks * self.block_size
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table) - num_computed_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()) -> bool:
        # A cache hit sitting in the free list is taken from it, so it does not count as free for others.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        needed = self._blocks_needed(seq, num_new_tokens, len(computed_blocks))
        return needed <= self.num_free_blocks - revived

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``; returns False, changing nothing, if
        the blocks are not there. On admission pass ``computed_blocks`` (from ``find_cached_blocks``,
        possibly empty): they become the head of the block table, count as computed, and the lookup
        is counted in the prefix-cache stats."""
        admission = computed_blocks is not None
        if admission and (seq.block_table or seq.num_computed_tokens):
            raise ValueError(f"sequence {seq.seq_id}: cached blocks can only be used on a fresh admission")
        computed_blocks = computed_blocks or ()
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        if admission and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
            seq.num_cached_tokens = len(computed_blocks) * self.block_size
            self._num_registered[seq.seq_id] = len(computed_blocks)
        needed = self._blocks_needed(seq, num_new_tokens, len(computed_blocks))
        for block_id in computed_blocks:
            self._evictable.on_hit(block_id)
            self._incref(block_id)
        seq.block_table.extend(computed_blocks)
        seq.num_computed_tokens += len(computed_blocks) * self.block_size
        seq.block_table.extend(self._take_fresh() for _ in range(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share ``parent``'s full computed blocks with ``child`` (at least one token is left for the child
        to compute). Returns the number of tokens the child starts with computed."""
        if child.block_table or child.num_computed_tokens:
            raise ValueError(f"sequence {child.seq_id} already holds KV; only a fresh sequence can fork")
        num_shared = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        shared_tokens = num_shared * self.block_size
        if child.token_ids[:shared_tokens] != parent.token_ids[:shared_tokens]:
            raise ValueError(f"sequence {child.seq_id} does not share a prefix with {parent.seq_id}")
        for block_id in parent.block_table[:num_shared]:
            self._incref(block_id)
        child.block_table = parent.block_table[:num_shared]
        child.num_computed_tokens = shared_tokens
        child.block_hashes = parent.block_hashes[:num_shared]
        self._num_registered[child.seq_id] = num_shared
        return shared_tokens

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its tail is freed first so that, among equally old blocks, the
        prefix blocks (most likely to be hit again) are evicted last."""
        for block_id in reversed(seq.block_table):
            self._decref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.seq_id, None)

    def release_unused_blocks(self, seq: Sequence) -> int:
        """Free the blocks at the end of ``seq``'s table that hold none of its tokens: after speculative
        decoding, the slots reserved for proposals the model rejected. Their contents are garbage beyond
        the sequence's length, and they were never registered in the prefix cache (only computed full
        blocks are). Returns the number of blocks freed."""
        keep = -(-seq.num_tokens // self.block_size)
        extra = seq.block_table[keep:]
        for block_id in reversed(extra):
            self._decref(block_id)
        del seq.block_table[keep:]
        return len(extra)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Physical cache slots of ``seq``'s token positions [start, end)."""
        return slot_mapping(seq.block_table, self.block_size, start, end)

    def _incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if block.block_hash is None:
                del self._empty[block_id]
            else:  # a cache hit on a free block revives it
                self._evictable.remove(block_id)
                if self._expiry is not None:
                    self._expiry.forget(block_id)
        block.ref_count += 1

    def _decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.block_hash is None:
            self._empty[block_id] = None
            self._empty.move_to_end(block_id, last=False)
        else:
            self._evictable.push(block_id)
            if self._expiry is not None:
                self._expiry.freed(block_id)

    def _take_fresh(self) -> int:
        if self._empty:
            block_id, _ = self._empty.popitem(last=False)
        else:
            block_id = self._evictable.pop()
            self._forget_contents(block_id)
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _drop(self, block_id: int) -> None:
        """Take evictable ``block_id`` out of the policy and forget its contents; the caller places it."""
        self._evictable.remove(block_id)
        self._forget_contents(block_id)

    def _forget_contents(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if self._expiry is not None:
            self._expiry.forget(block_id)
        self._evictable.on_dropped(block_id)
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
