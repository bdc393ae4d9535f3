"""One engine step with lookahead slots: propose, verify every proposal in one target pass, report."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.sampler import Sampler, SampleResult, SamplingRow
from app.engine.spec_decode.config import SpeculativeConfig
from app.engine.spec_decode.forward import SeqView, row_for, run_rows
from app.engine.spec_decode.metrics import SpecDecodeStats
from app.engine.spec_decode.proposers import DraftModelProposer, NgramProposer, Proposal
from app.engine.spec_decode.rejection_sampler import verify
from app.engine.spec_decode.uniforms import DRAW_ACCEPT, DRAW_FINAL, Uniforms

if TYPE_CHECKING:
    from collections.abc import Callable

    from app.engine.guided.bitmask import TokenBitmask
    from app.engine.model_runner import ModelRunner

__all__ = ["SpeculativeDecoder"]


class SpeculativeDecoder:
    """Runs engine steps that carry lookahead slots: propose, verify in one target pass, report."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        sampler: Sampler,
        *,
        vocab_size: int,
        draft: DraftModelProposer | None = None,
        seed: int | None = None,
    ) -> None:
        if config.method == "draft_model" and draft is None:
            raise ValueError("the draft_model method needs a DraftModelProposer")
        self.config = config
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.draft = draft
        self.ngram = (
            NgramProposer(config.prompt_lookup_min or 1, config.prompt_lookup_max or 1)
            if config.method == "ngram"
            else None
        )
        self.uniforms = Uniforms(seed)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.propose_s = 0.0  # time spent proposing (the draft model's passes), for benchmarks
        # Grammar masks for the rows sampled one token at a time (the engine's guided decoding), or None.
        self.guide: Callable[[Seq[Sequence]], TokenBitmask | None] | None = None

    def _mask(self, seqs: Seq[Sequence]) -> TokenBitmask | None:
        return self.guide(seqs) if self.guide is not None and seqs else None

    def _propose(self, requests: list[tuple[Sequence, int]]) -> list[Proposal]:
        t0 = time.perf_counter()
        if self.draft is not None:
            proposals = self.draft.propose(requests, self.uniforms)
        else:
            assert self.ngram is not None
            proposals = [Proposal(self.ngram.propose(seq.token_ids, k)) for seq, k in requests]
        self.propose_s += time.perf_counter() - t0
        return proposals

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[list[SampleResult]]]:
        """Run one scheduled step; returns the sequences that produced tokens and, for each, its tokens in
        order (accepted proposals, then the model's own token) with their logprobs when asked for."""
        requests = [
            (seq, out.num_lookahead_slots[seq.seq_id])
            for seq in out.scheduled
            if out.num_lookahead_slots.get(seq.seq_id, 0) > 0
        ]
        by_id = {
            seq.seq_id: prop
            for (seq, _), prop in zip(requests, self._propose(requests), strict=True)
            if prop.tokens
        }
        if not by_id:  # nothing to verify (no n-gram matched): an ordinary step
            plain_logits, plain_seqs = self.runner.execute(out)
            rows = [SamplingRow.from_sequence(s) for s in plain_seqs]
            if not plain_seqs:
                return plain_seqs, []
            return plain_seqs, [[r] for r in self.sampler.sample(plain_logits, rows, self._mask(plain_seqs))]

        # One target pass: every scheduled sequence with its proposals appended.
        items: list[tuple[Sequence | SeqView, int]] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        total = 0
        for seq in out.scheduled:
            n = out.num_scheduled_tokens[seq.seq_id]
            prop = by_id.get(seq.seq_id)
            k = len(prop.tokens) if prop is not None else 0
            samples = seq.num_computed_tokens + n == seq.num_tokens
            if prop is not None and k:
                view = SeqView(seq, [*seq.token_ids, *prop.tokens], seq.num_computed_tokens)
                items.append((view, n + k))
            else:
                items.append((seq, n))
            total += n + k
            if samples:
                sample_rows.extend(range(total - k - 1, total))
                sampling_seqs.append(seq)
        logits = run_rows(self.runner, items, sample_rows)

        plain: list[int] = []  # indices into sampling_seqs: an ordinary one-token sample
        spec: list[int] = []
        row_of: list[int] = []  # first logits row of each sampling sequence
        row = 0
        for i, seq in enumerate(sampling_seqs):
            prop = by_id.get(seq.seq_id)
            row_of.append(row)
            if prop is not None and prop.tokens:
                spec.append(i)
                row += len(prop.tokens) + 1
            else:
                plain.append(i)
                row += 1
        results: list[list[SampleResult]] = [[] for _ in sampling_seqs]
        if plain:
            index = torch.tensor([row_of[i] for i in plain], dtype=torch.long, device=logits.device)
            plain_seqs = [sampling_seqs[i] for i in plain]
            plain_results = self.sampler.sample(
                logits.index_select(0, index),
                [SamplingRow.from_sequence(seq) for seq in plain_seqs],
                self._mask(plain_seqs),
            )
            for i, res in zip(plain, plain_results, strict=True):
                results[i] = [res]
        if spec:
            self._verify(
                logits, [sampling_seqs[i] for i in spec], [row_of[i] for i in spec], by_id, results, spec
            )
        return sampling_seqs, results

    def _verify(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        first_rows: list[int],
        by_id: dict[int, Proposal],
        results: list[list[SampleResult]],
        slots: list[int],
    ) -> None:
        proposals = [by_id[s.seq_id] for s in seqs]
        rows_index: list[int] = []
        sampling_rows: list[SamplingRow] = []
        accept_draws: list[tuple[Sequence, int]] = []
        final_draws: list[tuple[Sequence, int]] = []
        for seq, prop, first in zip(seqs, proposals, first_rows, strict=True):
            k = len(prop.tokens)
            rows_index.extend(range(first, first + k + 1))
            sampling_rows.extend(row_for(seq, prop.tokens[:j]) for j in range(k + 1))
            accept_draws.extend((seq, seq.num_output_tokens + j) for j in range(k))
            final_draws.extend((seq, seq.num_output_tokens + j) for j in range(k + 1))
        index = torch.tensor(rows_index, dtype=torch.long, device=logits.device)
        spec_logits = logits.index_select(0, index)
        probs = self.sampler.target_probs(spec_logits, sampling_rows)
        num_accepted, final = verify(
            probs,
            proposals,
            self.uniforms.draw(accept_draws, DRAW_ACCEPT),
            self.uniforms.draw(final_draws, DRAW_FINAL),
        )
        self.stats.record([len(p.tokens) for p in proposals], num_accepted)

        # The emitted tokens, with logprobs from the rows that predicted them when a request wants them.
        emitted: list[list[int]] = []
        score_rows: list[int] = []
        score_sampling: list[SamplingRow] = []
        score_tokens: list[int] = []
        offset = 0
        for seq, prop, a, token in zip(seqs, proposals, num_accepted, final, strict=True):
            tokens = [*prop.tokens[:a], token]
            emitted.append(tokens)
            if seq.sampling_params.needs_sample_logprob:
                score_rows.extend(range(offset, offset + a + 1))
                score_sampling.extend(sampling_rows[offset : offset + a + 1])
                score_tokens.extend(tokens)
            offset += len(prop.tokens) + 1
            if self.draft is not None:
                self.draft.accepted(seq, seq.num_tokens, len(prop.tokens), a)
        scored = iter(
            self.sampler.score(
                spec_logits.index_select(0, torch.tensor(score_rows, dtype=torch.long, device=logits.device)),
                score_sampling,
                score_tokens,
            )
            if score_rows
            else []
        )
        for slot, seq, tokens in zip(slots, seqs, emitted, strict=True):
            if seq.sampling_params.needs_sample_logprob:
                results[slot] = [next(scored) for _ in tokens]
            else:
                results[slot] = [SampleResult(t) for t in tokens]
