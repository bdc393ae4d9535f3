"""An evaluation example by example (``GET /v1/evaluations/{id}/examples``): each example's input and target
(from the evaluation's dataset), output, score, feedback and error, optionally beside a baseline evaluation's
output and score for the same example, so a regression can be traced to the examples that got worse.

Examples pair by index; datasets of different lengths pair over their common prefix. A failed example scores 0.0,
as it counts in the evaluation's mean. An evaluation that has not finished answers with what it has stored (no
scores yet), and one stored before outputs were kept answers ``output: null``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.db.optimization_models import Evaluation
from app.db.repository import runs
from app.jobs.encoding import to_jsonable
from app.jobs.errors import InvalidJobInput, JobError, JobNotFound
from app.jobs.learning.common import load_examples
from app.jobs.learning.evaluations import load_evaluation
from app.jobs.submission import Limits
from app.pipeline.optimization import Example

ORDERS = ("index", "regressions")
MAX_LIMIT = 500
_SAME = 1e-9  # score differences below this are unchanged
_ANY_SIZE = Limits(max_items=10**9, max_bytes=10**12)  # the dataset was checked when the evaluation was made


@dataclass(frozen=True)
class Outcome:
    """What one evaluation stored for one example."""

    output: Any
    score: float | None
    feedback: str | None
    error: str | None


def compare_examples(
    session: Session,
    evaluation_id: str,
    *,
    owner: str | None = None,
    baseline: str | None = None,
    order: str = "index",
    below: float | None = None,
    offset: int = 0,
    limit: int = 50,
) -> dict[str, Any]:
    """``{"object": "list", "evaluation_id", "baseline_id", "summary", "data", "total", "has_more"}``; see the
    module docstring. ``below`` keeps the examples scored below it; ``order="regressions"`` puts the largest
    drops against the baseline first and the examples without a pairing last."""
    _check(order, below, offset, limit)
    row = load_evaluation(session, evaluation_id, owner)
    base = _baseline(session, baseline, owner) if baseline else None  # an empty baseline= is none
    outcomes = _outcomes(row)
    base_outcomes = _outcomes(base) if base is not None else []
    examples = _examples(session, row)
    count = max(len(outcomes), len(examples) if examples is not None else 0)
    rows = [_row(i, examples, outcomes, base_outcomes if base is not None else None) for i in range(count)]
    summary = _summary(rows, row, base)
    shown = [r for r in rows if below is None or (r["score"] is not None and r["score"] < below)]
    if order == "regressions":
        shown.sort(key=lambda r: (r["delta"] is None, r["delta"] if r["delta"] is not None else 0.0, r["index"]))
    page = shown[offset:offset + limit]
    return {
        "object": "list",
        "evaluation_id": row.id,
        "baseline_id": base.id if base is not None else None,
        "summary": summary,
        "data": page,
        "total": len(shown),
        "has_more": offset + len(page) < len(shown),
    }


def _check(order: str, below: float | None, offset: int, limit: int) -> None:
    if order not in ORDERS:
        raise InvalidJobInput(f"unknown order {order!r}; use one of {', '.join(ORDERS)}", param="order")
    if below is not None and math.isnan(below):
        raise InvalidJobInput("below must be a number (only examples scored below it are shown)", param="below")
    if offset < 0:
        raise InvalidJobInput(f"offset must be 0 or more, not {offset}", param="offset")
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidJobInput(f"limit must be between 1 and {MAX_LIMIT}, not {limit}", param="limit")


def _baseline(session: Session, baseline_id: str, owner: str | None) -> Evaluation:
    row = runs.get_run(session, Evaluation, run_id=baseline_id, owner=owner)
    if row is None:
        raise JobNotFound(f"no evaluation {baseline_id!r} to compare with: baseline must be the id of one of your "
                          "evaluations (GET /v1/evaluations)", param="baseline", code="evaluation_not_found")
    return row


def _outcomes(row: Evaluation) -> list[Outcome]:
    """The stored per-example results; a failed example scores 0.0 where the loss gives scores."""
    scores = list(row.scores or [])
    details = row.details or {}
    feedback = list(details.get("feedback") or [])
    outputs = details.get("outputs")
    errors = details.get("errors") or {}
    scored = any(s is not None for s in scores)
    found = []
    for i, score in enumerate(scores):
        error = errors.get(str(i)) if isinstance(errors, dict) else None
        found.append(Outcome(
            output=outputs[i] if isinstance(outputs, list) and i < len(outputs) else None,
            score=0.0 if error is not None and scored else score,
            feedback=feedback[i] if i < len(feedback) else None,
            error=error,
        ))
    return found


def _examples(session: Session, row: Evaluation) -> list[Example] | None:
    """The evaluation's dataset, or None when it cannot be read any more (its file was deleted)."""
    try:
        return load_examples(session, (row.request or {}).get("dataset"), owner=row.owner, limits=_ANY_SIZE)
    except JobError:
        return None


def _row(index: int, examples: list[Example] | None, outcomes: list[Outcome],
         base_outcomes: list[Outcome] | None) -> dict[str, Any]:
    example = examples[index] if examples is not None and index < len(examples) else None
    mine = outcomes[index] if index < len(outcomes) else None
    theirs = base_outcomes[index] if base_outcomes is not None and index < len(base_outcomes) else None
    score = mine.score if mine is not None else None
    delta = None
    if theirs is not None and score is not None and theirs.score is not None:
        delta = score - theirs.score
    return {
        "index": index,
        "input": _shown_input(example) if example is not None else None,
        "target": to_jsonable(example.target) if example is not None else None,
        "output": mine.output if mine is not None else None,
        "score": score,
        "feedback": mine.feedback if mine is not None else None,
        "error": mine.error if mine is not None else None,
        "baseline": {"output": theirs.output, "score": theirs.score} if theirs is not None else None,
        "delta": delta,
    }


def _shown_input(example: Example) -> Any:
    """The example's input as the dataset gave it: one argument alone, keyword arguments as an object."""
    if example.kwargs and not example.args:
        return to_jsonable(example.kwargs)
    return to_jsonable(example.args[0] if len(example.args) == 1 else list(example.args))


def _summary(rows: list[dict[str, Any]], row: Evaluation, base: Evaluation | None) -> dict[str, Any]:
    deltas = [r["delta"] for r in rows if r["delta"] is not None]
    return {
        "count": len(rows),
        "mean": row.score,
        "baseline_mean": base.score if base is not None else None,
        "paired": len(deltas),
        "improved": sum(1 for d in deltas if d > _SAME),
        "regressed": sum(1 for d in deltas if d < -_SAME),
        "unchanged": sum(1 for d in deltas if abs(d) <= _SAME),
    }
