"""Continuous-batching scheduler: decides, step by step, which sequences run and how many tokens each.

One engine step is ``schedule()`` → the model runner computes the scheduled tokens and samples →
``update(output, sampled)``. Every sequence is handled by the same rule: it needs
``num_tokens - num_computed_tokens`` more tokens computed (the whole prompt on admission, one token when
decoding, prompt + outputs after a preemption), the scheduler hands out chunks of that under a token
budget, and the step that reaches ``num_tokens`` samples one new token.

Speculative decoding adds *lookahead slots*: a decoding sequence may get up to ``num_lookahead_slots`` more
cache slots (and as many tokens of the budget) for proposed tokens that the model verifies in the same pass.
The scheduler only reserves them; ``update`` then receives several tokens for that sequence, counts the
verified ones as computed, and releases the blocks that only the rejected proposals used.

Which waiting sequences a step admits is the batching strategy's choice (``batching_strategy``:
``continuous``, ``bucketed`` or ``memory_aware``, see :mod:`app.engine.core.admission`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from app.engine.core.admission import BatchingStrategyName, check_batching_strategy, make_admission
from app.engine.core.block_manager import BlockManager
from app.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; the caller should shed load (HTTP 503/429)."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Bound on queued sequences checked by add(); preempted ones re-enter regardless. None: unbounded
    # (offline batches add everything at once); servers should set it.
    max_waiting: int | None = None
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one sequence's prefill chunk per step
    max_model_len: int | None = None  # None: whatever the KV cache can hold
    # Speculative decoding: extra slots per decoding sequence for proposed tokens (0: none), and the number
    # of running sequences from which none are reserved (large batches gain nothing from speculation).
    num_lookahead_slots: int = 0
    lookahead_disable_batch_size: int | None = None
    # Admission (see app.engine.core.admission); bucketed groups prompts by num_tokens // batching_bucket_size.
    batching_strategy: BatchingStrategyName = "continuous"
    batching_bucket_size: int = 128

    def __post_init__(self) -> None:
        check_batching_strategy(self.batching_strategy)
        for name in ("max_num_seqs", "max_num_batched_tokens", "batching_bucket_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {self.num_lookahead_slots}")
        optional = (
            "max_waiting",
            "long_prefill_token_threshold",
            "max_model_len",
            "lookahead_disable_batch_size",
        )
        for name in optional:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class SchedulerOutput:
    scheduled: list[Sequence] = field(default_factory=list)  # batch order: decodes, prefills, admissions
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # seq id -> tokens this step
    preempted: list[Sequence] = field(default_factory=list)  # the runner may drop their state
    # seq id -> cache slots reserved past its scheduled tokens for proposed tokens (speculative decoding)
    num_lookahead_slots: dict[int, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def will_sample(self, seq: Sequence) -> bool:
        """Whether this step completes ``seq``'s pending tokens and so must sample for it."""
        return seq.num_computed_tokens + self.num_scheduled_tokens[seq.seq_id] == seq.num_tokens


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage_perc: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cached_blocks: int
    eviction_policy: str = "lru"
    prefix_cache_evictions: int = 0  # cached blocks given up for fresh ones
    prefix_cache_expirations: int = 0  # cached blocks dropped by the time-to-live


def _rank(policy: str, seq: Sequence) -> tuple[float, ...]:
    """Smaller = served first and preempted last: arrival (fcfs), or priority then arrival. The seq id
    breaks ties, so siblings of one request keep their order."""
    if policy == "priority":
        return (seq.priority, seq.arrival_time, seq.seq_id)
    return (seq.arrival_time, seq.seq_id)


class _WaitingQueue:
    """A heap on the policy's rank. A preempted sequence re-enters by its rank, which under fcfs puts it
    back at the front (it arrived before anything still waiting)."""

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self._heap: list[tuple[tuple[float, ...], Sequence]] = []

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (_rank(self._policy, seq), seq))

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        if self._heap and self._heap[0][1] is seq:
            heapq.heappop(self._heap)
            return
        self._heap = [e for e in self._heap if e[1] is not seq]
        heapq.heapify(self._heap)

    def ranked(self, keep: Callable[[Sequence], bool]) -> list[Sequence]:
        """The waiting sequences for which ``keep`` holds, in rank order (sorting only those)."""
        return [seq for _, seq in sorted((e for e in self._heap if keep(e[1])), key=lambda e: e[0])]

    def __contains__(self, seq: object) -> bool:
        return any(e[1] is seq for e in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (e[1] for e in sorted(self._heap, key=lambda e: e[0]))


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        capacity = block_manager.num_blocks * block_manager.block_size
        # A sequence is stopped at this length, so one sequence alone always fits in the cache.
        self.max_model_len = min(config.max_model_len or capacity, capacity)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be "
                f">= the maximum sequence length ({self.max_model_len}), or long sequences could never run"
            )
        self.waiting = _WaitingQueue(config.policy)
        self.running: list[Sequence] = []
        self.requests: dict[str, SequenceGroup] = {}
        self._pending_forks: dict[int, list[Sequence]] = {}  # parent seq id -> children not yet forked
        self.num_preemptions = 0
        self.admission = make_admission(
            config.batching_strategy,
            block_manager=block_manager,
            max_model_len=self.max_model_len,
            bucket_size=config.batching_bucket_size,
        )

    # ---- requests in and out ----
    def add(self, request: Sequence | SequenceGroup) -> SequenceGroup:
        group = request if isinstance(request, SequenceGroup) else SequenceGroup.from_sequence(request)
        parent = group.parent
        if group.request_id in self.requests:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        if parent.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {group.request_id!r}: the prompt has {parent.num_tokens} tokens, more than the "
                f"maximum sequence length of {self.max_model_len}"
            )
        if len(group.seqs) > self.config.max_num_seqs:
            raise ValueError(f"n={len(group.seqs)} exceeds max_num_seqs={self.config.max_num_seqs}")
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.requests[group.request_id] = group
        if len(group.seqs) > 1:
            self._pending_forks[parent.seq_id] = group.seqs[1:]
        self.waiting.push(parent)
        return group

    def abort(self, request_id: str) -> bool:
        """Abort every unfinished sequence of a request, wherever it is; False if the id is unknown."""
        group = self.requests.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            self.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def finish_sequence(
        self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> None:
        """Finish ``seq`` and release its blocks. Also the hook for the detokenizing layer, which
        finds stop strings: it calls this with FINISHED_STOPPED and the matched string."""
        if seq.is_finished:
            return
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.stop_reason = status, stop_reason
        group = self.requests.get(seq.request_id)
        if seq is (group.parent if group else None):
            for child in self._pending_forks.pop(seq.seq_id, []):  # never forked: finish them too
                child.status = status
        if group is not None and group.is_finished:
            del self.requests[seq.request_id]

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes first (cheap, latency-sensitive), then unfinished prefills.
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        speculate = self.config.num_lookahead_slots > 0 and (
            self.config.lookahead_disable_batch_size is None
            or len(self.running) < self.config.lookahead_disable_batch_size
        )
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, seq.num_uncomputed_tokens, budget)
            if n == 0:  # an unsplittable prefill that does not fit what is left of the budget
                continue
            lookahead = (
                self._lookahead(seq, budget - n) if speculate and seq.num_uncomputed_tokens == 1 else 0
            )
            if lookahead and not self.block_manager.can_allocate(seq, n + lookahead):
                # Proposals are optional: without free blocks for them, use what is left of the sequence's
                # last block rather than preempt anyone.
                room = len(seq.block_table) * self.block_manager.block_size - seq.num_computed_tokens - n
                lookahead = max(0, min(lookahead, room))
            if lookahead and self.block_manager.allocate_slots(seq, n + lookahead):
                out.num_lookahead_slots[seq.seq_id] = lookahead
                budget -= self._schedule_seq(seq, n, out) + lookahead
                continue
            # Out of blocks: preempt the lowest-ranked running sequence, possibly this one, until it fits.
            while not self.block_manager.allocate_slots(seq, n):
                victim = self._victim()
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                budget -= self._schedule_seq(seq, n, out)

        self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admissions, in policy order as the batching strategy picks them. None after preempting in this
        step: memory is short and admitting would thrash. The priority policy may still preempt
        lower-ranked running sequences for a waiting one."""
        if out.preempted:
            return
        strategy = self.admission
        strategy.begin(self.running, self._seats)
        seats_used = self._seats_in_use()
        while len(self.waiting) and budget > 0:
            seq = strategy.candidate(self.waiting)
            if seq is None:
                break
            if seats_used + self._seats(seq) <= self.config.max_num_seqs:
                hits = self.block_manager.find_cached_blocks(seq)
                num_hit_tokens = len(hits) * self.block_manager.block_size
                n = self._chunk(seq, seq.num_tokens - num_hit_tokens, budget, computed=num_hit_tokens)
                if n == 0:
                    break  # does not fit the budget unchunked; keep the order, do not skip ahead
                if strategy.fits(seq, hits) and self.block_manager.allocate_slots(seq, n, hits):
                    self.waiting.remove(seq)
                    seq.status = SequenceStatus.RUNNING
                    self.running.append(seq)
                    budget -= self._schedule_seq(seq, n, out)
                    seats_used += self._seats(seq)
                    strategy.admitted(seq)  # before forking: it counts the children still to come
                    self._maybe_fork(seq)
                    continue
            # No seat, no blocks, or no room in the projection for this sequence.
            returned = self._preempt_for(seq, out)
            if returned is None:
                break
            strategy.preempted()
            budget += returned
            seats_used = self._seats_in_use()

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[int, int | list[int]]
    ) -> list[Sequence]:
        """Apply one step's results. ``sampled_token_ids`` maps seq id to the token sampled for it, or to
        several (speculative decoding: accepted proposals, then the model's own token), appended until a
        stop condition; all but the last were verified in this step, so their KV counts as computed.
        Entries for sequences that did not sample (partial prefill chunks) are ignored. Returns the
        sequences that finished in this step."""
        live = [s for s in output.scheduled if s.status is SequenceStatus.RUNNING]  # not aborted meanwhile
        for seq in live:  # check before changing anything, so a runner bug leaves the state intact
            tokens = sampled_token_ids.get(seq.seq_id)
            if output.will_sample(seq) and (tokens is None or (not isinstance(tokens, int) and not tokens)):
                raise ValueError(
                    f"no sampled token for sequence {seq.seq_id}, whose pending tokens were computed"
                )
        finished: list[Sequence] = []
        for seq in live:
            n = output.num_scheduled_tokens[seq.seq_id]
            if seq.num_computed_tokens + n < seq.num_tokens:
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
                self._maybe_fork(seq)
                continue
            tokens = sampled_token_ids[seq.seq_id]
            status: SequenceStatus | None = None
            appended = 0
            for token in [tokens] if isinstance(tokens, int) else tokens:
                seq.append_token(token)
                appended += 1
                status = self._check_stop(seq)
                if status is not None:
                    break
            seq.num_computed_tokens += n + appended - 1
            self.block_manager.cache_full_blocks(seq)  # before finishing, so its blocks stay reusable
            if status is not None:
                self.finish_sequence(seq, status, seq.stop_reason)
                finished.append(seq)
            elif seq.seq_id in output.num_lookahead_slots:
                self.block_manager.release_unused_blocks(seq)  # those held only rejected proposals
        return finished

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache_usage_perc=bm.kv_cache_usage_perc,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_cached_blocks=bm.num_cached_blocks,
            eviction_policy=bm.eviction_policy,
            prefix_cache_evictions=bm.num_evictions,
            prefix_cache_expirations=bm.num_expirations,
        )

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- helpers ----
    def _chunk(self, seq: Sequence, remaining: int, budget: int, computed: int | None = None) -> int:
        """How many of ``remaining`` tokens to schedule now; 0 if they cannot be split and do not fit."""
        computed = seq.num_computed_tokens if computed is None else computed
        if seq.seq_id in self._pending_forks and computed < self._fork_point(seq):
            # Stop at the fork point so the children can share everything before it.
            remaining = min(remaining, self._fork_point(seq) - computed)
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        if remaining > 1 and self.config.long_prefill_token_threshold:
            remaining = min(remaining, self.config.long_prefill_token_threshold)
        return min(remaining, budget)

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Lookahead slots for decoding ``seq``: no proposal may reach past the maximum length or beyond
        the last token ``max_tokens`` allows (the model's own token follows the accepted proposals). None
        for a sequence constrained by a grammar: it is not speculated (see ``app.engine.spec_decode``)."""
        if seq.sampling_params.structured_outputs is not None:
            return 0
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.config.num_lookahead_slots, room, budget))

    def _seats(self, seq: Sequence) -> int:
        """Running slots ``seq`` takes: its own and those its children will take once forked."""
        return 1 + len(self._pending_forks.get(seq.seq_id, ()))

    def _seats_in_use(self) -> int:
        return sum(self._seats(s) for s in self.running)

    def _fork_point(self, seq: Sequence) -> int:
        """Prompt tokens in full blocks that children can share: all but the block with the last token."""
        bs = self.block_manager.block_size
        return (seq.num_prompt_tokens - 1) // bs * bs

    def _maybe_fork(self, parent: Sequence) -> None:
        if parent.seq_id in self._pending_forks and parent.num_computed_tokens >= self._fork_point(parent):
            for child in self._pending_forks.pop(parent.seq_id):
                self.block_manager.fork(parent, child)
                child.num_cached_tokens = parent.num_cached_tokens
                child.status = SequenceStatus.RUNNING
                self.running.append(child)

    def _schedule_seq(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        out.scheduled.append(seq)
        out.num_scheduled_tokens[seq.seq_id] = n
        return n

    def _key(self, seq: Sequence) -> tuple[float, ...]:
        return _rank(self.config.policy, seq)

    def _victim(self) -> Sequence:
        return max(self.running, key=self._key)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt by recompute: free the blocks, keep the outputs, requeue. Returns the
        tokens given back to this step's budget if ``seq`` had already been scheduled in it."""
        self.running.remove(seq)
        self.block_manager.free(seq)  # also resets num_computed_tokens
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)
        out.preempted.append(seq)
        if seq.seq_id in out.num_scheduled_tokens:
            out.scheduled.remove(seq)
            return out.num_scheduled_tokens.pop(seq.seq_id) + out.num_lookahead_slots.pop(seq.seq_id, 0)
        return 0

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Priority policy: make room for waiting ``seq`` by preempting a running sequence that ranks
        strictly below it. Returns the budget tokens given back, or None (nothing done) under fcfs or
        when no running sequence ranks below ``seq``."""
        if self.config.policy != "priority" or not self.running:
            return None
        victim = self._victim()
        if self._key(victim) <= self._key(seq):
            return None
        return self._preempt(victim, out)

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        # Stop tokens before length, so a final eos reports "stop". Both wait for min_tokens.
        params, token = seq.sampling_params, seq.last_token_id
        if seq.num_output_tokens >= params.min_tokens:
            if token == seq.eos_token_id and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED
            if token in (params.stop_token_ids or ()):
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if seq.num_tokens >= self.max_model_len or (
            max_tokens is not None and seq.num_output_tokens >= max_tokens
        ):
            return SequenceStatus.FINISHED_LENGTH
        return None
