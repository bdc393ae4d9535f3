"""Sequences (one sample being generated) and sequence groups (one request with ``n`` samples).

Token accounting follows one rule, the same for prefill, chunked prefill, decode and recompute after
preemption: ``token_ids`` is the prompt followed by the outputs, ``num_computed_tokens`` of them have their
KV in the cache, and a step that computes up to ``num_tokens`` yields logits for one new token.
"""

from __future__ import annotations

import enum
import itertools
import time

from app.engine.core.hidden_states import cache_salt
from app.engine.core.sampling_params import SamplingParams

BlockHash = bytes

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # eos, a stop token id or (set by the detokenizer) a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context length
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """One sample of a request: its tokens, its KV-cache progress and its block table."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        index: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must contain at least one token")
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + outputs, kept whole to avoid concatenating
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.priority = priority
        # monotonic: only differences and ordering matter, and they must not jump with the wall clock
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the last admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks, filled lazily by the block manager. Valid for the
        # whole life of the sequence because tokens are only ever appended.
        self.block_hashes: list[BlockHash] = []
        # hidden states: an intervened request's blocks hash apart from clean ones; a capture computes every
        # position itself, so it reads no cached prefix (its own blocks are clean and cached for others)
        params = self.sampling_params
        self.cache_salt: bytes | None = cache_salt(params.interventions)
        self.reads_prefix_cache = params.capture is None

    def spawn(self, index: int) -> Sequence:
        """A fresh sibling sample with the same prompt, options and arrival (for n > 1)."""
        return Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_id=self.eos_token_id,
            priority=self.priority,
            arrival_time=self.arrival_time,
            index=index,
        )

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """One request: ``sampling_params.n`` sequences sharing a prompt (``best_of`` when larger: the candidates
    of which the ``n`` best are returned).

    Only the first sequence (the parent) is queued and prefilled. Once its computed tokens cover every
    *full* block of the prompt except the one holding the last prompt token, the scheduler forks the
    others: each child shares those blocks (ref-counted, never written again) and computes the short tail
    of the prompt into its own last block, then samples its own first token. The shared blocks are
    read-only by construction, so no copy-on-write is ever needed; the price is recomputing at most
    ``block_size`` prompt tokens per child.
    """

    def __init__(self, seqs: list[Sequence]) -> None:
        if not seqs:
            raise ValueError("a sequence group needs at least one sequence")
        if len({s.request_id for s in seqs}) != 1:
            raise ValueError("all sequences of a group must share one request id")
        self.seqs = seqs

    @classmethod
    def from_sequence(cls, seq: Sequence) -> SequenceGroup:
        """Group ``seq`` with ``n - 1`` (or ``best_of - 1``) freshly spawned siblings."""
        return cls([seq] + [seq.spawn(i) for i in range(1, seq.sampling_params.num_candidates)])

    @property
    def request_id(self) -> str:
        return self.seqs[0].request_id

    @property
    def parent(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
