"""The Pareto front over validation examples that GEPA keeps (arXiv 2507.19457, Algorithm 2).

For each validation example, the candidates with the highest score on it "win" it. A parent is drawn among the
candidates that win at least one example and are not dominated (a candidate whose won examples are a strict subset
of another's, or the same set as one with a higher mean, adds nothing), with probability proportional to the
number of examples it wins: a candidate that is the only one to get some examples right stays in play even when
its mean is lower.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

_TIE = 1e-9


class ParetoFront:
    """``add(candidate_id, scores)`` per validated candidate; ``wins()`` and ``choose(rng, means)``."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a Pareto front needs at least one validation example")
        self.best: list[float | None] = [None] * size
        self.winners: list[set[int]] = [set() for _ in range(size)]

    def add(self, candidate: int, scores: Sequence[float]) -> None:
        if len(scores) != len(self.best):
            raise ValueError(f"expected {len(self.best)} validation scores, got {len(scores)}")
        for index, score in enumerate(scores):
            top = self.best[index]
            if top is None or score > top + _TIE:
                self.best[index], self.winners[index] = score, {candidate}
            elif abs(score - top) <= _TIE:
                self.winners[index].add(candidate)

    def wins(self) -> dict[int, int]:
        """How many validation examples each candidate on the front wins (ties count for every winner)."""
        counts: dict[int, int] = {}
        for group in self.winners:
            for candidate in group:
                counts[candidate] = counts.get(candidate, 0) + 1
        return counts

    def frontier(self, means: Mapping[int, float]) -> dict[int, int]:
        """The non-dominated candidates and their win counts."""
        won: dict[int, set[int]] = {}
        for index, group in enumerate(self.winners):
            for candidate in group:
                won.setdefault(candidate, set()).add(index)
        kept: dict[int, int] = {}
        for candidate, examples in won.items():
            dominated = any(
                other != candidate and (examples < others or (examples == others and _better(other, candidate, means)))
                for other, others in won.items()
            )
            if not dominated:
                kept[candidate] = len(examples)
        return kept

    def choose(self, rng: random.Random, means: Mapping[int, float]) -> int:
        """A parent, drawn with probability proportional to its wins among the non-dominated candidates."""
        kept = self.frontier(means)
        ids = sorted(kept)
        return rng.choices(ids, weights=[kept[i] for i in ids])[0]


def _better(a: int, b: int, means: Mapping[int, float]) -> bool:
    """``a`` stands for ``b`` when they win the same examples: the higher mean, then the older candidate."""
    return (means.get(a, 0.0), -a) > (means.get(b, 0.0), -b)
