"""The random numbers of speculative decoding: one float64 uniform per ``(sequence, output position)`` and
stream, counter-based for seeded requests."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from app.engine.sampler import seeded_uniform

if TYPE_CHECKING:
    from app.engine.core.sequence import Sequence

__all__ = ["DRAW_ACCEPT", "DRAW_FINAL", "DRAW_PROPOSE", "Uniforms"]


# Seeded requests draw their uniforms from seeded_uniform(seed, index, position, draw); the sampler uses draw
# numbers 0..64 (top-p rounds), so speculation takes its own streams far above them.
DRAW_ACCEPT = 1 << 20
DRAW_FINAL = (1 << 20) + 1
DRAW_PROPOSE = (1 << 20) + 2


class Uniforms:
    """Uniforms for speculative draws: counter-based for seeded requests (the same whatever the batch),
    from one generator for the others."""

    def __init__(self, seed: int | None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed ^ 0x5EED5EED)

    def draw(self, items: Seq[tuple[Sequence, int]], stream: int) -> torch.Tensor:
        """One float64 uniform per ``(sequence, output position)``."""
        fresh = torch.rand(len(items), dtype=torch.float64, generator=self.generator).tolist()
        values = [
            seeded_uniform(seed, seq.index, position, stream)
            if (seed := seq.sampling_params.seed) is not None
            else u
            for (seq, position), u in zip(items, fresh, strict=True)
        ]
        return torch.tensor(values, dtype=torch.float64)
