"""One forward pass over sequences whose tokens have proposals appended (the target's verification pass, the
draft's passes), with the logits of chosen rows only, and the sampling row of a sequence as if its proposals
had already been generated."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.sampler import SamplingRow

if TYPE_CHECKING:
    from app.engine.model_runner import ModelRunner

__all__ = ["SeqView", "row_for", "run_rows"]


class SeqView:
    """A sequence as :meth:`ModelRunner.prepare` should see it: proposals appended to its tokens and/or
    another computed count (the draft model's progress). Anything else is read from the real sequence."""

    __slots__ = ("_seq", "num_computed_tokens", "token_ids")

    def __init__(self, seq: Sequence, token_ids: list[int], num_computed_tokens: int) -> None:
        self._seq = seq
        self.token_ids = token_ids
        self.num_computed_tokens = num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seq, name)


def run_rows(
    runner: ModelRunner, items: list[tuple[Sequence | SeqView, int]], sample_rows: list[int]
) -> torch.Tensor:
    """One forward pass over ``(sequence or view, tokens to compute)`` items; logits of the given flat rows."""
    step = SchedulerOutput(
        scheduled=[cast(Sequence, seq) for seq, _ in items],
        num_scheduled_tokens={seq.seq_id: n for seq, n in items},
    )
    t0 = time.perf_counter()
    batch = runner.prepare(step)
    index = torch.tensor(sample_rows, dtype=torch.long).to(runner.device, non_blocking=True)
    batch = replace(batch, sample_index=index, sampling_seqs=[])
    t1 = time.perf_counter()
    logits = runner.run(batch)
    tm = runner.timings
    tm.prepare_s += t1 - t0
    tm.forward_s += time.perf_counter() - t1
    tm.num_steps += 1
    tm.num_tokens += batch.attn.num_tokens
    return logits


def row_for(seq: Sequence, extra: Seq[int]) -> SamplingRow:
    """The sampling row of ``seq`` as if ``extra`` tokens had already been generated after its output."""
    return SamplingRow(
        params=seq.sampling_params,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=[*seq.output_token_ids, *extra] if extra else seq.output_token_ids,
        seq_index=seq.index,
        eos_token_id=seq.eos_token_id,
    )
