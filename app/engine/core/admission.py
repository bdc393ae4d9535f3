"""Batching strategies: which waiting sequences a step admits, on top of the scheduler's own token-budget,
seat and free-block checks.

- ``continuous`` (the default): the head of the waiting queue, in policy order, for as long as it fits, so
  every step tops the batch up as far as the budget and the free blocks allow.
- ``bucketed``: a step's first admission is the head of the queue (so nothing starves); its other
  admissions must fall in the same prompt-length bucket (``num_tokens // bucket_size``), in policy order.
  Sequences of similar lengths are batched together and move through prefill and decode in step.
- ``memory_aware``: a sequence is admitted only if the blocks it may come to need (prompt plus
  ``max_tokens``, capped by the maximum length; the whole remaining length without ``max_tokens``) fit in
  the free blocks left after what the running sequences may still need, projected the same way. It admits
  less at once than ``continuous`` but never into a cache that must later preempt for it. With nothing
  running the head is admitted regardless, so a sequence larger than its projection still runs.

Per step the scheduler calls ``begin``, then repeatedly ``candidate`` → ``fits`` (before allocating) →
``admitted``, and ``preempted`` when it preempts a running sequence meanwhile (priority scheduling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol, get_args

from app.engine.core.block_manager import BlockManager
from app.engine.core.sequence import Sequence, SequenceStatus

BatchingStrategyName = Literal["continuous", "bucketed", "memory_aware"]
BATCHING_STRATEGIES: tuple[str, ...] = get_args(BatchingStrategyName)

SeatsFn = Callable[[Sequence], int]  # running slots a sequence takes: 1 + its children not yet forked


def check_batching_strategy(value: object, field: str = "batching_strategy") -> str:
    """``value`` if it names a strategy, else a ValueError naming ``field`` and the allowed values."""
    if value not in BATCHING_STRATEGIES:
        allowed = ", ".join(map(repr, BATCHING_STRATEGIES))
        raise ValueError(f"{field} must be one of {allowed}, got {value!r}")
    return str(value)


class WaitingView(Protocol):
    """What a strategy reads of the scheduler's waiting queue."""

    def peek(self) -> Sequence: ...

    def ranked(self, keep: Callable[[Sequence], bool]) -> list[Sequence]:
        """The waiting sequences for which ``keep`` holds, in policy order."""
        ...


class ContinuousAdmission:
    """Always the head of the queue; the scheduler's checks are the only limit."""

    name = "continuous"

    def begin(self, running: list[Sequence], seats: SeatsFn) -> None:
        """A step's admissions start. ``running`` is the scheduler's own list (admissions join it)."""

    def candidate(self, waiting: WaitingView) -> Sequence | None:
        """The next sequence to try (None: admit nothing more this step); the queue is not empty."""
        return waiting.peek()

    def fits(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether ``seq``, for which ``hits`` cached blocks were found, may be admitted now."""
        return True

    def admitted(self, seq: Sequence) -> None:
        """``seq`` was admitted (its first blocks are allocated)."""

    def preempted(self) -> None:
        """A running sequence was preempted during this step's admissions."""


class BucketedAdmission(ContinuousAdmission):
    name = "bucketed"

    def __init__(self, bucket_size: int) -> None:
        self.bucket_size = bucket_size
        self._bucket: int | None = None  # this step's, once its first sequence is admitted
        self._group: list[Sequence] | None = None  # the bucket's waiting sequences, best ranked last

    def bucket(self, seq: Sequence) -> int:
        return seq.num_tokens // self.bucket_size

    def begin(self, running: list[Sequence], seats: SeatsFn) -> None:
        self._bucket, self._group = None, None

    def candidate(self, waiting: WaitingView) -> Sequence | None:
        if self._bucket is None:
            return waiting.peek()
        if self._group is None:  # one pass over the queue per step, after its first admission
            bucket = self._bucket
            self._group = waiting.ranked(lambda s: self.bucket(s) == bucket)[::-1]
        while self._group and self._group[-1].status is not SequenceStatus.WAITING:
            self._group.pop()  # admitted or finished (aborted) since
        return self._group[-1] if self._group else None

    def admitted(self, seq: Sequence) -> None:
        if self._bucket is None:
            self._bucket = self.bucket(seq)


class MemoryAwareAdmission(ContinuousAdmission):
    name = "memory_aware"

    def __init__(self, block_manager: BlockManager, max_model_len: int) -> None:
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._running: list[Sequence] = []
        self._seats: SeatsFn = lambda seq: 1
        self._reserved: int | None = None  # blocks the running sequences may still take; None: recount

    def projected_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds once it has all its tokens: prompt + ``max_tokens``, capped by the length."""
        max_tokens = seq.sampling_params.max_tokens
        final = self.max_model_len
        if max_tokens is not None:
            final = min(final, seq.num_tokens + max_tokens - seq.num_output_tokens)
        return -(-final // self.block_manager.block_size)

    def _still_needed(self, seq: Sequence) -> int:
        """Blocks ``seq`` may still take, its children not yet forked included (they share the prompt's
        full blocks and need their own for the rest)."""
        own = self.projected_blocks(seq)
        shared = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        children = (self._seats(seq) - 1) * max(0, own - shared)
        return max(0, own - len(seq.block_table)) + children

    def begin(self, running: list[Sequence], seats: SeatsFn) -> None:
        self._running, self._seats = running, seats
        self._reserved = None

    def fits(self, seq: Sequence, hits: list[int]) -> bool:
        if not self._running:
            return True  # progress: a lone sequence runs even if its projection exceeds the cache
        if self._reserved is None:
            self._reserved = sum(self._still_needed(s) for s in self._running)
        bm = self.block_manager
        revived = sum(1 for b in hits if bm.blocks[b].ref_count == 0)  # taken from the free blocks too
        fresh = self._still_needed(seq) - len(hits)
        return self._reserved + fresh + revived <= bm.num_free_blocks

    def admitted(self, seq: Sequence) -> None:
        if self._reserved is not None:
            self._reserved += self._still_needed(seq)

    def preempted(self) -> None:
        # The scheduler's running list changed under us; count again from it at the next check.
        self._reserved = None


AdmissionStrategy = ContinuousAdmission


def make_admission(
    name: str, *, block_manager: BlockManager, max_model_len: int, bucket_size: int
) -> AdmissionStrategy:
    check_batching_strategy(name)
    if name == "bucketed":
        return BucketedAdmission(bucket_size)
    if name == "memory_aware":
        return MemoryAwareAdmission(block_manager, max_model_len)
    return ContinuousAdmission()
