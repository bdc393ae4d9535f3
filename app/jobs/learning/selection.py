"""The selection-gated optimizer in a training job: its validation set, how each step is stored (the step's
candidates beside its scores, a parameter version for each new best) and how the history reads back.

A training with ``optimizer.type == "gepa"`` (the default) chooses on ``validation_dataset``; without one it holds
out a seeded third of ``dataset`` (at least one example) and trains on the rest, so demonstrations never come from
the examples it chooses on.
"""

from __future__ import annotations

import random
from typing import Any

from app.jobs.encoding import to_jsonable
from app.jobs.errors import InvalidJobInput
from app.pipeline.optimization import Example, SelectionStep


def split_validation(examples: list[Example], validation: list[Example] | None,
                     seed: int | None) -> tuple[list[Example], list[Example]]:
    """``(train, validation)``: the validation set given, else a seeded third of the examples held out."""
    if validation is not None:
        return examples, validation
    if len(examples) < 2:
        raise InvalidJobInput("the gepa optimizer chooses on a validation set: give validation_dataset, or at least "
                              "two examples in dataset (a third is held out)", param="validation_dataset")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, len(examples) // 3)])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def check_budget(budget: int, minibatch: int, train: int, validation: int) -> None:
    need = validation + 2 * min(minibatch, train)
    if budget < need:
        raise InvalidJobInput(
            f"optimizer.budget {budget} cannot pay for one validation ({validation} metric calls) and one step (twice "
            f"the minibatch, {2 * min(minibatch, train)}): give at least {need}", param="optimizer")


def estimated_steps(budget: int, minibatch: int, candidates: int, train: int, validation: int) -> int:
    """Steps the budget pays for when every step scores all its candidates and validates one."""
    per_step = min(minibatch, train) * (1 + candidates) + validation
    return max(1, (budget - validation) // per_step)


def step_values(step: SelectionStep, changes: list[dict[str, Any]], version: int | None) -> dict[str, Any]:
    """The ``training_steps`` row of one step: the parent's minibatch scores (the seed's validation scores for
    step 0), the parameter changes of a new best, and every candidate."""
    if step.step == 0:
        (seed,) = step.candidates
        score, scores = seed.val_score, list(seed.val_scores or [])
    else:
        first = step.candidates[0] if step.candidates else None
        scores = list(first.parent_scores) if first is not None else []
        score = sum(scores) / len(scores) if scores else None
    return {
        "step": step.step, "epoch": 0, "batch": step.step, "score": score, "scores": scores,
        "updates": to_jsonable(changes), "errors": {}, "version": version,
        "candidates": to_jsonable([c.to_dict() for c in step.candidates]),
    }


def best_changes(step: SelectionStep, before: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameter changes of the step's new best against the previous best (none when the best stayed)."""
    best = next((c for c in step.candidates if c.best), None)
    if best is None or step.step == 0:
        return []
    return [
        {"name": name, "old_value": before.get(name), "new_value": value, "changed": True, "step": step.step,
         "candidate": best.id, "val_score": best.val_score, "feedback": best.note, "feedback_items": [],
         "scores": list(best.scores)}
        for name, value in sorted(best.state.items()) if before.get(name) != value
    ]


def candidate_views(steps: list[Any]) -> list[dict[str, Any]]:
    """Every stored candidate of a training, in the order proposed (the seed first)."""
    return [dict(c) for row in steps for c in (getattr(row, "candidates", None) or [])]
