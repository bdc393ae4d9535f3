"""Proposers: cheap guesses of a sequence's next tokens, for the target model to verify.

:class:`NgramProposer` copies what followed the latest earlier occurrence of the sequence's last n-gram
(prompt lookup, free to compute); :class:`DraftModelProposer` runs a smaller model (or the same one)
autoregressively over its own KV cache and keeps the distributions it drew from, which the rejection sampler
needs.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.engine.sampling_ops import invert_cdf
from app.engine.spec_decode.forward import SeqView, row_for, run_rows
from app.engine.spec_decode.uniforms import DRAW_PROPOSE, Uniforms

if TYPE_CHECKING:
    from app.engine.core.sequence import Sequence
    from app.engine.models.base import PagedCausalLM
    from app.engine.sampler import Sampler
    from app.engine.spec_decode.config import SpeculativeConfig

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal"]


@dataclass
class Proposal:
    """Proposed tokens for one sequence; ``probs[j]`` is the distribution ``tokens[j]`` was drawn from, or
    None when every proposal was deterministic (one-hot q: n-grams, greedy requests)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n`` tokens (longest ``n``
    first, from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed it.
    When the occurrence is so recent that fewer than ``k`` tokens follow it, the text is periodic and the
    proposal continues the period.

    Free to compute and strong on text that repeats its context (extraction, code edits, summaries that
    quote). The search runs in C: the ids are packed as 8-byte integers and searched with ``bytes.rfind``.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    @staticmethod
    def _continue(token_ids: Seq[int], start: int, k: int) -> list[int]:
        """The ``k`` tokens from ``start`` on, copying on into the proposal itself when they run past the end
        (an occurrence close to the end means the text repeats with that period, LZ77-style)."""
        length = len(token_ids)
        out = list(token_ids[start : start + k])
        while len(out) < k:
            out.append(out[start + len(out) - length])
        return out

    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
        length = len(token_ids)
        if k < 1 or length < self.min_n + 1:
            return []
        data = array("q", token_ids).tobytes()
        width = 8
        # An occurrence must end before the last token, so that at least one token follows it.
        limit = (length - 1) * width
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = data[(length - n) * width :]
            end = limit
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % width == 0:  # a match at a token boundary, not across the bytes of two ids
                    return self._continue(token_ids, at // width + n, k)
                end = at + len(suffix) - 1  # keep looking to the left of this misaligned match
        return []


class DraftModelProposer:
    """Proposals from a draft model that runs autoregressively over its own KV cache.

    The draft cache has the target's block layout (same number of blocks, same block size) and follows the
    target's block tables, so it needs no allocator of its own: the draft writes its KV for position ``p``
    of a sequence into the slot where the target keeps that position. Its progress per sequence is tracked
    here; a sequence seen for the first time (or again after a preemption, which gave it new blocks) is
    caught up by one draft prefill. Proposals are drawn from the draft's distribution under the request's
    own sampling options (greedy requests: its argmax), so a draft equal to the target is always accepted.
    """

    def __init__(
        self,
        model: PagedCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        from app.engine.model_runner import ModelRunner

        draft_vocab = model.config.vocab_size
        if draft_vocab > target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab}) is larger than the target's "
                f"({target_vocab_size}): the draft must use the target's tokenizer"
            )
        self.model = model
        self.vocab_size = target_vocab_size
        self.sampler = sampler
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device
        )
        # seq id -> (sequence, its num_preemptions when recorded, tokens whose draft KV is in the cache)
        self._progress: dict[int, tuple[Sequence, int, int]] = {}

    @classmethod
    def from_config(
        cls,
        spec: SpeculativeConfig,
        *,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
        cache_dir: str | Path | None = None,
    ) -> DraftModelProposer:
        """The proposer of a ``draft_model`` config: its ``model`` loaded when it is a path (or used as
        given), checked to cover the target's ``max_model_len``."""
        from app.engine.models.base import PagedCausalLM

        draft_model = spec.model
        if isinstance(draft_model, str | Path):
            from app.engine.loading import load_model  # deferred: pulls in settings and safetensors

            draft_model, _, _ = load_model(draft_model, dtype=dtype, device=device, cache_dir=cache_dir)
        if not isinstance(draft_model, PagedCausalLM):
            raise ValueError(
                "speculative_config 'model' must be a path or a loaded engine model (PagedCausalLM), "
                f"got {type(draft_model).__name__}"
            )
        draft_len = draft_model.config.max_position_embeddings
        if draft_len < max_model_len:
            raise ValueError(
                f"the draft model's context ({draft_len}) is shorter than max_model_len "
                f"({max_model_len}); set max_model_len <= {draft_len}"
            )
        return cls(
            draft_model,
            num_blocks=num_blocks,
            block_size=block_size,
            target_vocab_size=target_vocab_size,
            dtype=dtype,
            device=device,
            sampler=sampler,
        )

    def _computed(self, seq: Sequence) -> int:
        entry = self._progress.get(seq.seq_id)
        if entry is None or entry[1] != seq.num_preemptions:
            return 0
        return min(entry[2], seq.num_tokens - 1)

    def propose(self, requests: list[tuple[Sequence, int]], uniforms: Uniforms) -> list[Proposal]:
        """Up to ``k`` proposals for each ``(sequence, k)``, batched: one catch-up pass that ends on each
        sequence's last token, then one single-token pass per further proposal."""
        self._forget_finished()
        proposals = [Proposal([]) for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, (_, k) in enumerate(requests) if k > 0]
        step = 0
        while active:
            items: list[tuple[Sequence | SeqView, int]] = []
            rows: list[int] = []
            total = 0
            for i in active:
                seq, _ = requests[i]
                drafted = proposals[i].tokens
                if step == 0:
                    start = self._computed(seq)
                    view = SeqView(seq, seq.token_ids, start)
                    n = seq.num_tokens - start
                else:
                    view = SeqView(seq, [*seq.token_ids, *drafted], seq.num_tokens + step - 1)
                    n = 1
                items.append((view, n))
                total += n
                rows.append(total - 1)
            logits = run_rows(self.runner, items, rows)
            if logits.shape[1] < self.vocab_size:  # a smaller draft vocabulary: the rest has no mass
                logits = torch.nn.functional.pad(
                    logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf")
                )
            sampling_rows = [row_for(requests[i][0], proposals[i].tokens) for i in active]
            q = self.sampler.target_probs(logits, sampling_rows)
            u = uniforms.draw(
                [(requests[i][0], requests[i][0].num_output_tokens + step) for i in active], DRAW_PROPOSE
            )
            tokens = invert_cdf(q, u).tolist()
            for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                proposals[i].tokens.append(int(token))
                if not requests[i][0].sampling_params.is_greedy:
                    q_rows[i].append(q[row])
            step += 1
            active = [i for i in active if requests[i][1] > step]
        for i, (seq, _) in enumerate(requests):
            if q_rows[i]:
                proposals[i].probs = torch.stack(q_rows[i])
            if requests[i][1] > 0:  # its catch-up pass covered every real token
                self._progress[seq.seq_id] = (seq, seq.num_preemptions, seq.num_tokens)
        return proposals

    def accepted(self, seq: Sequence, num_tokens_before: int, num_proposed: int, num_accepted: int) -> None:
        """After verification: the draft also holds KV for the proposals it fed back that were accepted
        (all but the last proposal were fed back)."""
        entry = self._progress.get(seq.seq_id)
        if entry is not None and num_proposed > 0:
            self._progress[seq.seq_id] = (
                seq,
                entry[1],
                num_tokens_before + min(num_accepted, num_proposed - 1),
            )

    def _forget_finished(self) -> None:
        done = [sid for sid, (seq, _, _) in self._progress.items() if seq.is_finished]
        for sid in done:
            del self._progress[sid]
