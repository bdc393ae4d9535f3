"""Losses turn outputs into Feedback: the Loss base (single outputs and concurrent batches), VerifierLoss and
CompositeLoss. LLM judges live in ``judges.py``, human feedback in ``human.py``."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from app.pipeline.optimization.feedback import Feedback, FeedbackType, mean_score
from app.pipeline.optimization.llm import ChatLLM, non_empty
from app.pipeline.record import split_output


def broadcast(value: Any, n: int, what: str) -> list[Any]:
    """Per-item values of a batch: a list of length ``n`` is per item; anything else applies to every item."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(
                f"the batch has {n} outputs but {len(value)} {what}s: give one {what} per output, or a single "
                f"{what} (not a list) for all of them"
            )
        return list(value)
    return [value] * n


class Loss:
    """Evaluates an output (or a list of outputs) and returns Feedback.

    ``await loss(output, target)`` evaluates one output; a list of outputs is a batch whose items are evaluated
    concurrently and summarised in one Feedback (mean score, each item's feedback in ``items``). Outputs from a
    module in training mode carry their forward record, which the Feedback keeps for ``backward()``.
    Subclasses define ``async evaluate(output, target=None, *, context=None) -> Feedback`` on plain values.
    """

    feedback_type: FeedbackType = FeedbackType.VERIFIER

    async def __call__(
        self,
        output: Any,
        target: Any = None,
        *,
        context: dict[str, Any] | list[Any] | None = None,
        record: Any = None,
    ) -> Feedback:
        if isinstance(output, list):
            return await self._evaluate_batch(output, target, context, record)
        value, found = split_output(output, record)
        feedback = await self._evaluate_single(value, target, context=context)
        return feedback.attach_record(found)

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        raise NotImplementedError(
            f"{type(self).__name__} must define `async def evaluate(self, output, target=None, *, context=None)"
            " -> Feedback`"
        )

    async def _evaluate_single(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        feedback = await self.evaluate(output, target, context=context)
        if not isinstance(feedback, Feedback):
            raise TypeError(f"{type(self).__name__}.evaluate must return a Feedback, got {type(feedback).__name__}")
        return feedback

    async def _evaluate_batch(self, outputs: list[Any], targets: Any, context: Any, records: Any) -> Feedback:
        n = len(outputs)
        if n == 0:
            raise ValueError(f"{type(self).__name__} was given an empty batch of outputs")
        per_target = broadcast(targets, n, "target")
        per_context = broadcast(context, n, "context")
        per_record = broadcast(records, n, "record")
        split = [split_output(out, rec) for out, rec in zip(outputs, per_record, strict=True)]
        # a TaskGroup: the first failure cancels the other evaluations instead of leaving them running
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self._evaluate_single(value, tgt, context=ctx))
                for (value, _), tgt, ctx in zip(split, per_target, per_context, strict=True)
            ]
        items = [task.result().attach_record(rec) for task, (_, rec) in zip(tasks, split, strict=True)]
        return summarise_batch(items)

    def bind(self, resources: Any) -> Self:
        """Bind the LLMs this loss calls (no-op for losses that call none)."""
        return self


def summarise_batch(items: list[Feedback]) -> Feedback:
    """One Feedback for a batch: mean score, every item's content, and the items themselves for backward."""
    kinds = {f.feedback_type for f in items}
    content = "\n\n".join(f"[item {i + 1}{_score_tag(f)}] {f.content}" for i, f in enumerate(items))
    batch = Feedback(
        content,
        mean_score(items),
        kinds.pop() if len(kinds) == 1 else FeedbackType.COMPOSITE,
        {"batch_size": len(items), "scores": [f.score for f in items]},
    )
    batch._items.extend(items)
    return batch


def _score_tag(feedback: Feedback) -> str:
    return f", score {feedback.score:.2f}" if feedback.score is not None else ""


# -- programmatic checks ----------------------------------------------------------------------------------------
class VerifierLoss(Loss):
    """Feedback from code. ``verifier(output)`` or ``verifier(output, target)`` (sync or async) returns a bool,
    a score in [0, 1], or ``(passed_or_score, message)``; the message explains a failure."""

    feedback_type = FeedbackType.VERIFIER

    def __init__(
        self,
        verifier: Callable[..., Any],
        success_feedback: str = "Output passed verification.",
    ) -> None:
        if not callable(verifier):
            raise TypeError("VerifierLoss needs a function: VerifierLoss(lambda output: (ok, message))")
        self.verifier = verifier
        self.success_feedback = success_feedback
        self._takes_target = _accepts_two_args(verifier)

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        result = self.verifier(output, target) if self._takes_target else self.verifier(output)
        if inspect.isawaitable(result):
            result = await result
        verdict, message = (result if isinstance(result, tuple) and len(result) == 2 else (result, ""))
        score = _verdict_score(verdict)
        if score >= 1.0:
            content = self.success_feedback
        else:
            content = str(message) if message else f"Output failed verification (score {score:.2f})."
        return Feedback(content, score, FeedbackType.VERIFIER, {"message": str(message)} if message else {})


def _verdict_score(verdict: Any) -> float:
    if isinstance(verdict, bool):
        return 1.0 if verdict else 0.0
    if isinstance(verdict, int | float):
        if not 0.0 <= float(verdict) <= 1.0:
            raise ValueError(f"a verifier score must be within [0, 1], got {verdict}")
        return float(verdict)
    raise TypeError(
        f"a verifier must return a bool, a score in [0, 1] or (bool_or_score, message), got {type(verdict).__name__}"
    )


def _accepts_two_args(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= 2


def field_match(output: Any, target: Any) -> tuple[float, str]:
    """A verifier for structured outputs, field by field: the share of the target's fields that the output gives
    the same value (text compared case- and space-insensitively, numbers by value), and a message naming each
    field that differs. An output that is JSON text is parsed first; one that is not a dict scores 0."""
    if not isinstance(target, Mapping) or not target:
        raise ValueError(f"field_match needs a target dict of expected fields, got {type(target).__name__}")
    data = getattr(output, "payload", output)
    if isinstance(data, str):
        with contextlib.suppress(json.JSONDecodeError):
            data = json.loads(data)
    if not isinstance(data, Mapping):
        shown = str(data)[:120]
        return 0.0, f"The output should be a JSON object with the fields {sorted(target)}, but it was {shown!r}."
    wrong = [
        f"{key} should be {json.dumps(want)}, got {json.dumps(data[key], default=str) if key in data else 'nothing'}"
        for key, want in target.items() if key not in data or not _same(data[key], want)
    ]
    score = 1.0 - len(wrong) / len(target)
    return score, "" if not wrong else "Wrong fields: " + "; ".join(wrong) + "."


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, int | float) and isinstance(got, int | float):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(want, str) and isinstance(got, str):
        return " ".join(got.split()).casefold() == " ".join(want.split()).casefold()
    return bool(got == want)


# -- combinations -----------------------------------------------------------------------------------------------
class CompositeLoss(Loss):
    """A weighted combination: ``CompositeLoss([(format_check, 0.3), (judge, 0.7)])``. The score is the weighted
    mean of the components that gave one; the content lists each component's feedback, or, with
    ``aggregator`` (an alias or an LLMInference), an LLM's synthesis of them."""

    feedback_type = FeedbackType.COMPOSITE

    def __init__(self, losses: Sequence[tuple[Loss, float] | Loss], aggregator: Any = None) -> None:
        pairs: list[tuple[Loss, float]] = []
        for entry in losses:
            loss, weight = entry if isinstance(entry, tuple) else (entry, 1.0)
            if not isinstance(loss, Loss):
                raise TypeError(f"CompositeLoss takes (Loss, weight) pairs, got {type(loss).__name__}")
            if weight < 0:
                raise ValueError(f"a CompositeLoss weight must be >= 0, got {weight} for {type(loss).__name__}")
            pairs.append((loss, float(weight)))
        if not pairs:
            raise ValueError("CompositeLoss needs at least one (loss, weight) pair")
        if sum(w for _, w in pairs) <= 0:
            raise ValueError("CompositeLoss weights must not all be zero")
        self.losses = pairs
        self.aggregator: ChatLLM | None = None
        if aggregator is not None:
            alias = aggregator if isinstance(aggregator, str) else aggregator.alias
            self.aggregator = ChatLLM(
                alias,
                "You merge several evaluations of one output into one short, actionable critique. Keep every "
                "concrete problem, drop repetition, and say what to change.",
                owner="CompositeLoss",
            )

    def bind(self, resources: Any) -> Self:
        for loss, _ in self.losses:
            loss.bind(resources)
        if self.aggregator is not None:
            self.aggregator.bind(resources)
        return self

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(loss._evaluate_single(output, target, context=context))
                     for loss, _ in self.losses]
        parts = [task.result() for task in tasks]
        weights = [w for _, w in self.losses]
        names = [type(loss).__name__ for loss, _ in self.losses]
        listing = "\n\n".join(
            f"[{name}, weight {w:g}{_score_tag(f)}] {f.content}" for name, w, f in zip(names, weights, parts, strict=True)
        )
        content = listing
        if self.aggregator is not None:
            prompt = f"Evaluations of one output:\n\n{listing}\n\nWrite the merged critique."
            content = await self.aggregator.ask(prompt, non_empty, attempts=3, what="a merged critique")
        components = [
            {"loss": name, "weight": w, "score": f.score, "feedback_type": f.feedback_type.value}
            for name, w, f in zip(names, weights, parts, strict=True)
        ]
        return Feedback(content, mean_score(parts, weights), FeedbackType.COMPOSITE, {"components": components})
