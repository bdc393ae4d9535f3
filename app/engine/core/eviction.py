"""Which cached KV block to give up when a fresh one is needed: the eviction policies of the prefix cache.

The block manager hands every free block that still holds cached contents (a registered block hash) to an
:class:`EvictionPolicy`; a later hit takes it back (``remove``), and when no empty block is left the policy
names the victim (``pop``). Empty free blocks never reach a policy: they are always used first.

- ``lru``: the block freed longest ago goes first (today's behaviour; a sequence frees its tail first, so
  its prefix blocks, the likeliest to be hit again, go last).
- ``lfu``: the block used by the fewest requests goes first (its registering request plus every prefix hit
  on it), ties by ``lru``. A parent block is used at least as often as its children, so chains shrink from
  their tails.
- ``fifo``: the block cached earliest goes first, however often it was hit since.

Every operation is O(1) (``lru``) or O(log n) amortised (``lfu``, ``fifo``: a heap with lazy deletion).
:class:`ExpiryClock` adds the optional time-to-live of cached prefixes.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Literal, get_args

EvictionPolicyName = Literal["lru", "lfu", "fifo"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicyName)


def check_eviction_policy(value: object, field: str = "kv_cache_eviction_policy") -> str:
    """``value`` if it names a policy, else a ValueError naming ``field`` and the allowed values."""
    if value not in EVICTION_POLICIES:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, EVICTION_POLICIES))}, got {value!r}")
    return str(value)


def check_ttl(value: float | None, field: str = "prefix_cache_ttl_s") -> float | None:
    """A time-to-live is None (no expiry) or a positive number of seconds."""
    if value is not None and not value > 0:  # `not >` also rejects NaN
        raise ValueError(f"{field} must be a positive number of seconds or None, got {value!r}")
    return value


class EvictionPolicy(ABC):
    """The set of evictable blocks (free, with cached contents) and the order in which they are evicted."""

    name: str

    def on_cached(self, block_id: int) -> None:
        """``block_id`` was just registered under a block hash (it is in use, not yet evictable)."""
        return None  # most policies keep nothing per block

    def on_hit(self, block_id: int) -> None:
        """A request reuses ``block_id``'s cached contents (it may be evictable or in use)."""
        return None  # most policies keep nothing per block

    def on_dropped(self, block_id: int) -> None:
        """``block_id``'s cached contents are gone (evicted, expired, reset): forget what was kept for it."""
        return None  # most policies keep nothing per block

    @abstractmethod
    def push(self, block_id: int) -> None:
        """``block_id`` became free with its contents cached: it may now be evicted."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """``block_id`` is no longer evictable (a hit revived it, or its contents were dropped)."""

    @abstractmethod
    def pop(self) -> int:
        """Remove and return the block to evict next (a KeyError when there is none)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """The evictable blocks, in no particular order."""


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # front = freed longest ago

    def push(self, block_id: int) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop(self) -> int:
        if not self._order:
            raise KeyError("no evictable block")
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class _HeapPolicy(EvictionPolicy):
    """A min-heap on a key fixed while the block is evictable. Removal only forgets the block; its stale
    heap entry is skipped when it surfaces, and the heap is rebuilt once stale entries outnumber live ones,
    so memory stays O(n) and every operation O(log n) amortised."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[int, ...]] = {}  # evictable block -> its key in the heap
        self._heap: list[tuple[tuple[int, ...], int]] = []
        self._ticks = itertools.count()

    @abstractmethod
    def _key(self, block_id: int, tick: int) -> tuple[int, ...]:
        """Smaller = evicted sooner; ``tick`` counts pushes (a later push gets a larger one)."""

    def push(self, block_id: int) -> None:
        key = self._key(block_id, next(self._ticks))
        self._keys[block_id] = key
        heapq.heappush(self._heap, (key, block_id))

    def remove(self, block_id: int) -> None:
        del self._keys[block_id]
        if len(self._heap) > 2 * len(self._keys) + 16:
            self._heap = [(key, b) for b, key in self._keys.items()]
            heapq.heapify(self._heap)

    def pop(self) -> int:
        while self._heap:
            key, block_id = heapq.heappop(self._heap)
            if self._keys.get(block_id) == key:
                del self._keys[block_id]
                return block_id
        raise KeyError("no evictable block")

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._keys

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)


class LFUPolicy(_HeapPolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[int, int] = {}  # cached block -> requests that used it

    def on_cached(self, block_id: int) -> None:
        self._uses[block_id] = 1

    def on_hit(self, block_id: int) -> None:
        self._uses[block_id] = self._uses.get(block_id, 1) + 1

    def on_dropped(self, block_id: int) -> None:
        self._uses.pop(block_id, None)

    def _key(self, block_id: int, tick: int) -> tuple[int, ...]:
        # Uses cannot change while a block is evictable: a hit on it revives it (removes it) first.
        return (self._uses.get(block_id, 1), tick)


class FIFOPolicy(_HeapPolicy):
    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._cached_at: dict[int, int] = {}  # cached block -> when it was registered (a counter)
        self._registrations = itertools.count()

    def on_cached(self, block_id: int) -> None:
        self._cached_at[block_id] = next(self._registrations)

    def on_dropped(self, block_id: int) -> None:
        self._cached_at.pop(block_id, None)

    def _key(self, block_id: int, tick: int) -> tuple[int, ...]:
        return (self._cached_at.get(block_id, -1), tick)


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    return _POLICIES[check_eviction_policy(name)]()


class ExpiryClock:
    """The time-to-live of cached prefixes: a free cached block unused for ``ttl_s`` seconds loses its
    contents (a hit, or any request still using it, keeps it alive; the clock starts when its last user
    frees it). Blocks become free in time order, so the oldest sit at the front: expiring is O(1) per block."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        check_ttl(ttl_s)
        self.ttl_s = ttl_s
        self.clock = clock
        self._freed_at: OrderedDict[int, float] = OrderedDict()  # free cached block -> when, oldest first

    def freed(self, block_id: int) -> None:
        self._freed_at[block_id] = self.clock()
        self._freed_at.move_to_end(block_id)

    def forget(self, block_id: int) -> None:
        self._freed_at.pop(block_id, None)

    def expired(self) -> list[int]:
        """Remove and return the blocks whose time is up."""
        deadline = self.clock() - self.ttl_s
        out: list[int] = []
        while self._freed_at:
            block_id, freed_at = next(iter(self._freed_at.items()))
            if freed_at > deadline:
                break
            del self._freed_at[block_id]
            out.append(block_id)
        return out
