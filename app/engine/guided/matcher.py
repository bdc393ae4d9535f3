"""Per-sequence grammar matchers and the engine's guided-decoding state.

:class:`SequenceMatcher` wraps one xgrammar ``GrammarMatcher`` for one sequence and remembers how many of the
sequence's output tokens it has accepted. Before its mask row is filled it is *synced* to the sequence's
output: tokens it has not seen are accepted (catching up), tokens it accepted that are no longer in the
output are rolled back, and when the two histories differ it is rebuilt from the output. So whatever
happened in between (a preemption by recompute keeps the output tokens, a stop string drops the tokens after
it) the mask always follows the tokens the sequence really has.

:class:`GuidedDecoding` is what the engine talks to: the compiled grammar per request (from
:class:`~app.engine.guided.backend.GrammarCompiler`), a matcher per sequence (``n`` / ``best_of`` siblings each
have their own, created when first needed), the step's :class:`~app.engine.guided.bitmask.TokenBitmask` for
the constrained rows, and advancing the matchers with the tokens the scheduler appended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from app.engine.core.sampling_params import StructuredOutputsParams
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.guided.backend import GrammarCompiler
from app.engine.guided.bitmask import TokenBitmask, bitmask_words
from app.engine.guided.closing import BudgetCloser
from app.engine.guided.utf8 import Utf8Guard

if TYPE_CHECKING:
    from app.engine.tokenizer import Tokenizer

__all__ = ["GuidedDecoding", "SequenceMatcher"]

log = logging.getLogger(__name__)

FinishSequence = Callable[[Sequence, SequenceStatus], None]


class SequenceMatcher:
    """One sequence's grammar state: an xgrammar matcher and the output tokens it has accepted."""

    __slots__ = ("_compiled", "accepted", "closing", "failed", "matcher")

    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._compiled = compiled
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.accepted: list[int] = []  # the output tokens the matcher has consumed, in order
        self.failed = False  # a token the grammar does not allow reached it (a bug): no mask any more
        self.closing = False  # the budget is nearly spent: each step allows only the closing policy's token

    def accept(self, token_id: int) -> bool:
        if self.failed or self.matcher.is_terminated():
            return False
        if not self.matcher.accept_token(token_id):
            self.failed = True
            return False
        self.accepted.append(token_id)
        return True

    def sync(self, output_token_ids: Seq[int]) -> None:
        """Bring the matcher to exactly ``output_token_ids``: roll back what is no longer there, accept what
        is new, rebuild when the histories disagree before the common length."""
        accepted = self.accepted
        if len(accepted) == len(output_token_ids) and (not accepted or accepted[-1] == output_token_ids[-1]):
            return  # the usual case: nothing changed since the last step (tokens are only appended)
        common = min(len(accepted), len(output_token_ids))
        if accepted[:common] != list(output_token_ids[:common]):
            self.rebuild(output_token_ids)
            return
        if len(accepted) > common:
            self.matcher.rollback(len(accepted) - common)
            del accepted[common:]
            self.failed = False
        for token in output_token_ids[common:]:
            if not self.accept(token):
                break

    def rebuild(self, output_token_ids: Seq[int]) -> None:
        """A fresh matcher that has accepted ``output_token_ids`` (as far as the grammar allows them)."""
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(self._compiled)
        self.accepted = []
        self.failed = False
        self.closing = False
        for token in output_token_ids:
            if not self.accept(token):
                break

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) was accepted: nothing more may follow."""
        return bool(self.matcher.is_terminated())


class GuidedDecoding:
    """The engine's structured-output state: compiled grammars per request, matchers per sequence."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Seq[int],
        compiler: GrammarCompiler | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.compiler = compiler or GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._grammars: dict[str, Any] = {}  # request id -> compiled grammar
        self._matchers: dict[int, SequenceMatcher] = {}  # seq id -> matcher
        self._seq_ids: dict[str, list[int]] = {}  # request id -> its sequences' ids
        self._utf8: Utf8Guard | None = None  # built with the first mask (needs the grammar's vocabulary)
        self._closer: BudgetCloser | None = None  # likewise

    def __len__(self) -> int:
        """Constrained requests being tracked."""
        return len(self._grammars)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached); ValueError naming the problem. Thread-safe. The first call
        also builds the UTF-8 guard, so that neither happens in the step loop (AsyncEngine compiles off it)."""
        compiled = self.compiler.compile(spec)
        self._utf8_guard()
        self._budget_closer()
        return compiled

    def add_request(self, request_id: str, seqs: Iterable[Sequence], compiled: Any) -> None:
        self._grammars[request_id] = compiled
        self._seq_ids[request_id] = [s.seq_id for s in seqs]

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request (no-op for unknown ids)."""
        self._grammars.pop(request_id, None)
        for seq_id in self._seq_ids.pop(request_id, ()):
            self._matchers.pop(seq_id, None)

    def _matcher(self, seq: Sequence) -> SequenceMatcher | None:
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            compiled = self._grammars.get(seq.request_id)
            if compiled is None:
                return None
            matcher = self._matchers[seq.seq_id] = SequenceMatcher(compiled)
        return matcher

    def bitmask_for(self, seqs: Seq[Sequence]) -> TokenBitmask | None:
        """The step's grammar masks, one row per sequence in ``seqs`` (the logits rows), filled for the
        constrained ones; None when none is. Each matcher is synced to its sequence's output first."""
        if not self._grammars:
            return None
        rows: list[int] = []
        matchers: list[SequenceMatcher] = []
        for i, seq in enumerate(seqs):
            matcher = self._matcher(seq) if seq.sampling_params.structured_outputs is not None else None
            if matcher is None:
                continue
            matcher.sync(seq.output_token_ids)
            if matcher.failed or matcher.is_terminated:
                continue  # finished below, or by the update; nothing sensible to mask with
            rows.append(i)
            matchers.append(matcher)
        if not rows:
            return None
        bitmask = torch.full((len(seqs), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        guard = self._utf8_guard()
        for row, matcher in zip(rows, matchers, strict=True):
            matcher.fill(bitmask, row)
            guard.restrict(bitmask, row, seqs[row].output_token_ids)
            self._close_within_budget(matcher, seqs[row], bitmask, row)
        return TokenBitmask(bitmask, rows)

    def _close_within_budget(
        self, matcher: SequenceMatcher, seq: Sequence, bitmask: torch.Tensor, row: int
    ) -> None:
        """Near the end of the sequence's budget, narrow its row to the closing policy's token (see
        :mod:`.closing`), so that the output is a complete document when the budget ends."""
        left = (
            [seq.sampling_params.max_tokens - seq.num_output_tokens] if seq.sampling_params.max_tokens else []
        )
        if self.max_model_len is not None:
            left.append(self.max_model_len - seq.num_tokens)
        if not left:
            return
        closer = self._budget_closer()
        previous = seq.output_token_ids[-1] if seq.num_output_tokens else None
        if not matcher.closing:
            matcher.closing = closer.should_close(matcher.matcher, min(left), previous)
        if matcher.closing:
            closer.force(bitmask, row, previous)

    def _utf8_guard(self) -> Utf8Guard:
        if self._utf8 is None:
            self._utf8 = Utf8Guard(self.compiler.decoded_vocab(), self.vocab_size)
        return self._utf8

    def _budget_closer(self) -> BudgetCloser:
        if self._closer is None:
            self._closer = BudgetCloser(
                self.compiler.decoded_vocab(), self.vocab_size, self.compiler.stop_token_ids
            )
        return self._closer

    def advance(self, seqs: Seq[Sequence], num_before: Seq[int], finish: FinishSequence) -> None:
        """Feed each constrained sequence's newly appended tokens to its matcher. A matcher that reached its
        end finishes a sequence still running (finish_reason "stop", e.g. with ``ignore_eos``); a token the
        grammar rejects (only a bug can cause one) is logged and aborts that sequence alone."""
        if not self._grammars:
            return
        for seq, n0 in zip(seqs, num_before, strict=True):
            if seq.sampling_params.structured_outputs is None or seq.num_output_tokens == n0:
                continue
            matcher = self._matcher(seq)
            if matcher is not None and matcher.closing and seq.status is SequenceStatus.FINISHED_STOPPED:
                seq.status = SequenceStatus.FINISHED_LENGTH  # the budget closed it, not the model
            if matcher is None or seq.is_finished:
                continue  # finished in this step: its matcher is released with the request
            if len(matcher.accepted) != n0:
                matcher.sync(seq.output_token_ids[:n0])
            for token in seq.output_token_ids[n0:]:
                if not matcher.accept(token):
                    log.error(
                        "request %s: sampled token %d is not allowed by its grammar; aborting the sequence",
                        seq.request_id,
                        token,
                    )
                    finish(seq, SequenceStatus.FINISHED_ABORTED)
                    break
            else:
                if matcher.is_terminated:
                    closed = matcher.closing  # the budget ended it, not the model
                    finish(seq, SequenceStatus.FINISHED_LENGTH if closed else SequenceStatus.FINISHED_STOPPED)
