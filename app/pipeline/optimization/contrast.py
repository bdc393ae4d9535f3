"""Rubrics and the feedback that comparisons (preference, ranking) produce, shared by LLM and human losses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.pipeline.optimization.feedback import Feedback, FeedbackType

_SHOWN = 300


@dataclass(frozen=True)
class RubricLevel:
    """One level of a Likert-style rubric: ``RubricLevel(5, "Excellent", "complete and correct")``."""

    score: int
    label: str
    description: str = ""


def normalise_rubric(rubric: Any) -> list[RubricLevel]:
    """Accept RubricLevels, ``(score, label[, description])`` tuples or ``{score: description}``; sorted, checked."""
    levels: list[RubricLevel] = []
    items: Sequence[Any] = list(rubric.items()) if isinstance(rubric, Mapping) else list(rubric or [])
    for item in items:
        if isinstance(item, RubricLevel):
            levels.append(item)
        elif isinstance(item, tuple) and 2 <= len(item) <= 3:
            score, label, *rest = item
            levels.append(RubricLevel(int(score), str(label), str(rest[0]) if rest else ""))
        else:
            raise TypeError(
                f"a rubric level must be a RubricLevel or a (score, label[, description]) tuple, got {item!r}"
            )
    scores = [level.score for level in levels]
    if len(set(scores)) != len(scores):
        raise ValueError(f"rubric scores must be distinct, got {scores}")
    if len(levels) < 2:
        raise ValueError("a rubric needs at least two levels, e.g. [RubricLevel(1, 'Poor'), RubricLevel(5, 'Good')]")
    return sorted(levels, key=lambda level: level.score)


def rubric_text(levels: list[RubricLevel]) -> str:
    return "\n".join(
        f"  {level.score} - {level.label}" + (f": {level.description}" if level.description else "")
        for level in levels
    )


def rubric_score(levels: list[RubricLevel], raw: int) -> float:
    """A rubric score mapped onto [0, 1] (lowest level 0, highest 1)."""
    low, high = levels[0].score, levels[-1].score
    return (raw - low) / (high - low)


def shown(output: Any) -> str:
    text = str(output)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def preference_feedback(
    winner: str,
    output_a: Any,
    output_b: Any,
    *,
    reason: str,
    kind: FeedbackType,
    notes: Mapping[str, str] | None = None,
) -> tuple[Feedback, Feedback]:
    """Feedback for both sides of a pairwise comparison: the preferred one scores 1 and hears its strengths; the
    other scores 0 and hears why it lost, with the winner quoted as the example to move towards."""
    notes = notes or {}
    side = {"A": output_a, "B": output_b}
    loser = "B" if winner == "A" else "A"
    won = Feedback(
        f"Preferred over the alternative. {reason}".strip()
        + (f"\nStrengths: {notes[f'{winner.lower()}_strengths']}" if notes.get(f"{winner.lower()}_strengths") else ""),
        1.0, kind, {"preferred": True, "winner": winner},
    )
    weaknesses = notes.get(f"{loser.lower()}_weaknesses", "")
    lost = Feedback(
        f"The alternative output was preferred. Reason: {reason}"
        + (f"\nWeaknesses of this output: {weaknesses}" if weaknesses else "")
        + f"\nPreferred output (to move towards): {shown(side[winner])}",
        0.0, kind, {"preferred": False, "winner": winner},
    )
    return (won, lost) if winner == "A" else (lost, won)


def check_ranking(ranking: Sequence[int], n: int) -> list[int]:
    """A ranking (1-based indices, best first) must name each of the n outputs exactly once."""
    ranking = [int(r) for r in ranking]
    if sorted(ranking) != list(range(1, n + 1)):
        raise ValueError(
            f"a ranking must list each output number 1..{n} exactly once (best first), got {ranking}"
        )
    return ranking


def ranking_feedback(
    outputs: Sequence[Any],
    ranking: Sequence[int],
    *,
    kind: FeedbackType,
    best: str = "",
    worst: str = "",
    comparison: str = "",
    per_output: Sequence[str] = (),
) -> list[Feedback]:
    """One Feedback per output (input order), scored by rank: best 1.0, worst 0.0, linear between."""
    n = len(outputs)
    first = outputs[ranking[0] - 1]
    feedbacks: list[Feedback] = []
    for index in range(n):
        rank = ranking.index(index + 1) + 1
        own = per_output[index] if index < len(per_output) and per_output[index] else ""
        if rank == 1:
            text = f"Ranked #1 of {n} (best). {best}".strip()
        else:
            issue = worst if rank == n else comparison
            text = (f"Ranked #{rank} of {n}. {issue}".strip()
                    + f"\nThe best output (to move towards): {shown(first)}")
        if own:
            text += f"\nOn this output: {own}"
        feedbacks.append(Feedback(text, (n - rank) / (n - 1), kind, {"rank": rank, "total": n}))
    return feedbacks
