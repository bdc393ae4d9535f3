"""Speculative decoding's counters (vLLM's ``vllm:spec_decode_*`` metrics)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

__all__ = ["SpecDecodeStats"]


@dataclass
class SpecDecodeStats:
    """Cumulative counters, named like vLLM's ``vllm:spec_decode_*`` metrics."""

    num_drafts: int = 0  # sequence-steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # accepted, by proposal position

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: accepted proposals plus the model's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_proposed: Seq[int], num_accepted: Seq[int]) -> None:
        for k, a in zip(num_proposed, num_accepted, strict=True):
            if k == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            per_pos = self.num_accepted_tokens_per_pos
            if len(per_pos) < k:
                per_pos.extend([0] * (k - len(per_pos)))
            for j in range(a):
                per_pos[j] += 1

    def copy(self) -> SpecDecodeStats:
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))
