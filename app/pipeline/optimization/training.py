"""The training loop and held-out evaluation.

``history = await train(module, dataset, loss, optimizer, epochs=3, batch_size=4, shuffle=True, seed=0)`` runs,
per batch: the module in training mode on every example concurrently, ``loss(outputs, targets)``,
``feedback.backward()``, ``optimizer.step()``, ``optimizer.zero_feedback()``. A failed example is reported and
left out of backward (it has no output to learn from); a batch whose score is perfect (1.0) is not stepped on. ``on_step`` (sync or async) receives each TrainingStep
with the ParameterUpdates it made, which is what a training job persists.

A dataset is a list of examples: ``(input, target)`` pairs, or dicts with ``"input"`` (one positional argument)
or ``"inputs"`` (keyword arguments of forward) and an optional ``"target"``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from app.pipeline.optimization.feedback import Feedback
from app.pipeline.optimization.loss import Loss
from app.pipeline.optimization.optimizer import Optimizer, ParameterUpdate
from app.pipeline.record import split_output
from app.pipeline.resources.errors import ConfigurationError


@dataclass(frozen=True)
class Example:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any = None


def as_example(item: Any) -> Example:
    if isinstance(item, Example):
        return item
    if isinstance(item, Mapping):
        if "inputs" in item:
            inputs = item["inputs"]
            if not isinstance(inputs, Mapping):
                raise TypeError(f'an example\'s "inputs" are forward\'s keyword arguments (a dict), got {inputs!r}')
            return Example((), dict(inputs), item.get("target"))
        if "input" in item:
            return Example((item["input"],), {}, item.get("target"))
        raise ValueError(
            f"a dataset example must have an 'input' (or 'inputs' for keyword arguments) and may have a "
            f"'target'; got the keys {sorted(item)}"
        )
    if isinstance(item, tuple | list) and len(item) == 2:
        return Example((item[0],), {}, item[1])
    raise ValueError(
        "a dataset example is an (input, target) pair or a dict {'input': ..., 'target': ...}; got "
        f"{type(item).__name__}"
    )


@dataclass
class EvaluationResult:
    """Scores of a module on a dataset. ``score`` is the mean over examples that got one, a failed example
    counting as 0.0 (None when the loss gives no scores)."""

    score: float | None
    scores: list[float | None]
    feedback: list[Feedback | None]
    errors: dict[int, str] = field(default_factory=dict)  # example index -> what went wrong
    outputs: list[Any] = field(default_factory=list)  # each example's output value (None where it failed)

    @property
    def failures(self) -> int:
        return len(self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "scores": list(self.scores),
            "feedback": [f.content if f is not None else None for f in self.feedback],
            "errors": {str(k): v for k, v in self.errors.items()},
        }


@dataclass
class TrainingStep:
    epoch: int
    batch: int
    step: int
    score: float | None  # the batch loss's mean score (before this step's update)
    scores: list[float | None]
    updates: list[ParameterUpdate]
    errors: dict[int, str] = field(default_factory=dict)  # dataset index -> error of a failed example

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["updates"] = [u.to_dict() for u in self.updates]
        data["errors"] = {str(k): v for k, v in self.errors.items()}
        return data


@dataclass
class EpochSummary:
    epoch: int
    train_score: float | None
    eval_score: float | None
    state: dict[str, Any]


@dataclass
class TrainingHistory:
    initial_state: dict[str, Any]
    final_state: dict[str, Any] = field(default_factory=dict)
    steps: list[TrainingStep] = field(default_factory=list)
    epochs: list[EpochSummary] = field(default_factory=list)
    eval_before: EvaluationResult | None = None

    @property
    def scores(self) -> list[float | None]:
        """Each step's batch score, in order."""
        return [s.score for s in self.steps]

    @property
    def train_scores(self) -> list[float | None]:
        return [e.train_score for e in self.epochs]

    @property
    def eval_scores(self) -> list[float | None]:
        """Held-out scores: before training, then after each epoch (empty without an eval dataset)."""
        if self.eval_before is None:
            return []
        return [self.eval_before.score, *(e.eval_score for e in self.epochs)]

    @property
    def updates(self) -> list[ParameterUpdate]:
        return [u for s in self.steps for u in s.updates]

    def to_dict(self) -> dict[str, Any]:
        return {
            "initial_state": self.initial_state,
            "final_state": self.final_state,
            "steps": [s.to_dict() for s in self.steps],
            "epochs": [asdict(e) for e in self.epochs],
            "eval_before": self.eval_before.to_dict() if self.eval_before is not None else None,
        }


def _mean(scores: Sequence[float | None]) -> float | None:
    known = [s for s in scores if s is not None]
    return sum(known) / len(known) if known else None


async def _run_examples(module: Any, examples: list[Example], settings: dict[str, Any]) -> list[Any]:
    """Run every example concurrently; each slot holds the output (a TracedOutput in training mode) or the
    exception that example raised."""
    from app.pipeline.execution.executor import run_items

    results: list[Any] = [None] * len(examples)
    stream = run_items(module, [(e.args, e.kwargs) for e in examples], **settings)
    async for item in stream:
        if isinstance(item.error, ConfigurationError):
            raise item.error  # missing resources or aliases fail every example alike: not a per-example error
        results[item.index] = item.output if item.ok else item.error
    return results


async def _score(loss: Loss, outputs: list[Any], examples: list[Example]) -> tuple[Feedback | None, list[int]]:
    """The batch feedback over the examples that produced an output, and their positions."""
    ok = [i for i, out in enumerate(outputs) if not isinstance(out, BaseException)]
    if not ok:
        return None, ok
    feedback = await loss([outputs[i] for i in ok], [examples[i].target for i in ok])
    return feedback, ok


def _per_example(n: int, feedback: Feedback | None, ok: list[int]) -> list[Feedback | None]:
    per: list[Feedback | None] = [None] * n
    if feedback is not None:
        for i, item in zip(ok, feedback.items or [feedback], strict=False):
            per[i] = item
    return per


async def evaluate(
    module: Any,
    dataset: Sequence[Any],
    loss: Loss,
    *,
    resources: Any = None,
    max_concurrent: int | None = None,
) -> EvaluationResult:
    """Score the module (in eval mode) on every example of ``dataset`` with ``loss``."""
    examples = [as_example(item) for item in dataset]
    if not examples:
        raise ValueError("evaluate() needs a non-empty dataset")
    was_training = bool(getattr(module, "training", False))
    async with _scope(resources):
        module.eval()
        try:
            outputs = await _run_examples(module, examples, _settings(resources, max_concurrent))
        finally:
            module.train(was_training)
        feedback, ok = await _score(loss, outputs, examples)
    per = _per_example(len(examples), feedback, ok)
    errors = {i: _describe(out) for i, out in enumerate(outputs) if isinstance(out, BaseException)}
    scores: list[float | None] = [f.score if f is not None else None for f in per]
    any_score = any(s is not None for s in scores)
    counted = [0.0 if i in errors else s for i, s in enumerate(scores)] if any_score else scores
    values = [None if isinstance(out, BaseException) else split_output(out)[0] for out in outputs]
    return EvaluationResult(_mean(counted), scores, per, errors, values)


async def train(
    module: Any,
    dataset: Sequence[Any],
    loss: Loss,
    optimizer: Optimizer,
    epochs: int = 1,
    batch_size: int = 4,
    shuffle: bool = True,
    seed: int | None = None,
    *,
    eval_dataset: Sequence[Any] | None = None,
    on_step: Callable[[TrainingStep], Any] | None = None,
    resources: Any = None,
    max_concurrent: int | None = None,
) -> TrainingHistory:
    """Optimise the module's learnable parameters on ``dataset``; see the module docstring. With
    ``eval_dataset`` the held-out score is measured before training and after every epoch. ``resources`` run the
    module, and serve the loss and the optimizer too unless they were bound to their own."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    examples = [as_example(item) for item in dataset]
    if not examples:
        raise ValueError("train() needs a non-empty dataset")
    async with _scope(resources):
        return await _train(module, examples, loss, optimizer, epochs, batch_size, shuffle, seed, eval_dataset,
                            on_step, resources, max_concurrent)


async def _train(
    module: Any,
    examples: list[Example],
    loss: Loss,
    optimizer: Optimizer,
    epochs: int,
    batch_size: int,
    shuffle: bool,
    seed: int | None,
    eval_dataset: Sequence[Any] | None,
    on_step: Callable[[TrainingStep], Any] | None,
    resources: Any,
    max_concurrent: int | None,
) -> TrainingHistory:
    settings = _settings(resources, max_concurrent)
    rng = random.Random(seed)
    history = TrainingHistory(initial_state=dict(module.state_dict()))
    if eval_dataset is not None:
        history.eval_before = await evaluate(module, eval_dataset, loss, resources=resources,
                                             max_concurrent=max_concurrent)
    was_training = bool(getattr(module, "training", False))
    step_number = 0
    try:
        for epoch in range(epochs):
            order = list(range(len(examples)))
            if shuffle:
                rng.shuffle(order)
            epoch_scores: list[float | None] = []
            for batch_index, start in enumerate(range(0, len(order), batch_size)):
                step_number += 1
                indices = order[start:start + batch_size]
                step = await _train_step(module, [examples[i] for i in indices], indices, loss, optimizer,
                                         settings, epoch, batch_index, step_number)
                epoch_scores.extend(step.scores)
                history.steps.append(step)
                if on_step is not None:
                    result = on_step(step)
                    if inspect.isawaitable(result):
                        await result
            eval_score = None
            if eval_dataset is not None:
                eval_score = (await evaluate(module, eval_dataset, loss, resources=resources,
                                             max_concurrent=max_concurrent)).score
            history.epochs.append(EpochSummary(epoch, _mean(epoch_scores), eval_score, dict(module.state_dict())))
    finally:
        module.train(was_training)
    history.final_state = dict(module.state_dict())
    return history


async def _train_step(
    module: Any,
    batch: list[Example],
    indices: list[int],
    loss: Loss,
    optimizer: Optimizer,
    settings: dict[str, Any],
    epoch: int,
    batch_index: int,
    step_number: int,
) -> TrainingStep:
    optimizer.zero_feedback()
    module.train()
    outputs = await _run_examples(module, batch, settings)
    feedback, ok = await _score(loss, outputs, batch)
    per = _per_example(len(batch), feedback, ok)
    errors = {indices[i]: _describe(out) for i, out in enumerate(outputs) if isinstance(out, BaseException)}
    updates: list[ParameterUpdate] = []
    # a batch with a perfect score has nothing to teach; stepping on "passed" feedback only invites drift
    if feedback is not None and feedback.score != 1.0:
        await feedback.backward(optimizer=optimizer)
        await optimizer.step()
        updates = list(optimizer.last_updates)
    optimizer.zero_feedback()
    return TrainingStep(
        epoch=epoch,
        batch=batch_index,
        step=step_number,
        score=feedback.score if feedback is not None else None,
        scores=[f.score if f is not None else None for f in per],
        updates=updates,
        errors=errors,
    )


def _scope(resources: Any) -> AbstractAsyncContextManager[Any]:
    """Make ``resources`` the default of every call inside (the loss's judges, the optimizer's LLMs), sharing
    one ResourceManager and so one set of rate limits."""
    if resources is None:
        return nullcontext()
    from app.pipeline.run_settings import ExecutionSettings

    return ExecutionSettings(resources=resources)


def _settings(resources: Any, max_concurrent: int | None) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if resources is not None:
        settings["resources"] = resources
    if max_concurrent is not None:
        settings["max_concurrent"] = max_concurrent
    return settings


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
