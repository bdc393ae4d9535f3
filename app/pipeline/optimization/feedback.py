"""Feedback: the result of a loss, the language-model analogue of a loss tensor.

``await feedback.backward()`` propagates it through the forward records it carries (one per evaluated output),
accumulating parameter feedback that an optimizer's ``step()`` turns into new parameter values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.pipeline.execution.executor import ForwardRecord


class FeedbackType(str, Enum):
    """Where feedback came from."""

    HUMAN = "human"
    LLM_JUDGE = "llm_judge"
    VERIFIER = "verifier"
    COMPOSITE = "composite"


@dataclass
class Feedback:
    """What was good or bad about an output, and optionally a score in [0, 1] (1 is best).

    A loss attaches the forward record of each output it evaluated; a batch loss also keeps each item's own
    feedback (``items``), so that backward sends every record the critique of its own output, not the batch's.
    """

    content: str
    score: float | None = None
    feedback_type: FeedbackType = FeedbackType.HUMAN
    metadata: dict[str, Any] = field(default_factory=dict)
    _records: list[ForwardRecord] = field(default_factory=list, repr=False, compare=False)
    _items: list[Feedback] = field(default_factory=list, repr=False, compare=False)
    _optimizer: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.score is not None:
            score = float(self.score)
            if not 0.0 <= score <= 1.0:
                raise ValueError(f"a feedback score must be within [0, 1] (1 is best), got {self.score}")
            self.score = score
        if not isinstance(self.feedback_type, FeedbackType):
            self.feedback_type = FeedbackType(self.feedback_type)

    # -- records ----------------------------------------------------------------------------------------------
    @property
    def records(self) -> list[ForwardRecord]:
        """Every forward record this feedback can propagate through (its items' included)."""
        records = list(self._records)
        for item in self._items:
            records.extend(r for r in item.records if not any(r is seen for seen in records))
        return records

    @property
    def items(self) -> list[Feedback]:
        """Per-output feedback of a batch evaluation (empty for a single output)."""
        return list(self._items)

    def attach_record(self, record: ForwardRecord | None) -> Feedback:
        """Attach the forward record of the output this feedback is about (ignored when None)."""
        if record is not None and not any(record is r for r in self._records):
            self._records.append(record)
        return self

    # -- backward ---------------------------------------------------------------------------------------------
    async def backward(self, optimizer: Any = None) -> BackwardReport:
        """Propagate this feedback through every attached forward record (concurrently), accumulating feedback
        into the learnable Parameters that produced the outputs. ``optimizer`` (or the one a loss attached) lends
        its reasoning LLM to modules' ``backward`` and learns the graph order for its ``step()``."""
        if not self.records:
            raise RuntimeError(
                "this feedback has no forward record to propagate through: put the module in training mode "
                "(module.train()) before calling it, then give the loss the outputs exactly as the module "
                "returned them (or pass record=... from run(..., record=True))"
            )
        if _propagate is None:
            raise RuntimeError("feedback.backward() needs app.pipeline.optimization's backward pass: import it")
        return await _propagate(self, optimizer if optimizer is not None else self._optimizer)

    def __str__(self) -> str:
        return f"[{self.score:.2f}] {self.content}" if self.score is not None else self.content


@dataclass
class BackwardPass:
    """What backward did on one forward record."""

    order: list[str] = field(default_factory=list)  # nodes whose backward ran, in the order they ran
    node_feedback: dict[str, Feedback] = field(default_factory=dict)  # the combined feedback each node received
    parameter_feedback: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class BackwardReport:
    """What ``await feedback.backward()`` did: one pass per forward record."""

    passes: list[BackwardPass] = field(default_factory=list)

    @property
    def parameter_feedback(self) -> dict[str, list[str]]:
        merged: dict[str, list[str]] = {}
        for one in self.passes:
            for name, texts in one.parameter_feedback.items():
                merged.setdefault(name, []).extend(texts)
        return merged


#: ``propagate(feedback, optimizer)``: the backward pass, which builds on Feedback; ``app.pipeline.optimization``
#: installs ``propagation.propagate`` with ``install_propagation``.
Propagate = Callable[[Feedback, Any], Awaitable[BackwardReport]]
_propagate: Propagate | None = None


def install_propagation(propagate: Propagate) -> None:
    """Set what ``Feedback.backward`` runs (``app.pipeline.optimization`` installs ``propagation.propagate``)."""
    global _propagate
    _propagate = propagate


def as_feedback(obj: Any, like: Feedback | None = None) -> Feedback:
    """Coerce what a module's ``backward`` returned for an input (a Feedback, a string, anything with
    ``content``/``score``) into a Feedback; strings inherit score and type from ``like``."""
    if isinstance(obj, Feedback):
        return obj
    score = like.score if like is not None else None
    kind = like.feedback_type if like is not None else FeedbackType.HUMAN
    if isinstance(obj, str):
        return Feedback(obj, score, kind)
    content = getattr(obj, "content", None)
    if content is not None:
        return Feedback(str(content), getattr(obj, "score", score), kind)
    return Feedback(str(obj), score, kind)


def mean_score(feedbacks: list[Feedback], weights: list[float] | None = None) -> float | None:
    """Weighted mean of the scores that exist (None when no feedback has a score)."""
    weights = weights if weights is not None else [1.0] * len(feedbacks)
    pairs = [(f.score, w) for f, w in zip(feedbacks, weights, strict=True) if f.score is not None and w > 0]
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    return min(1.0, max(0.0, sum(s * w for s, w in pairs) / total))


def combine_feedback(feedbacks: list[Feedback], sources: list[str] | None = None) -> Feedback:
    """Merge the feedback that several consumers sent to one node (fan-out): contents listed with where each
    came from, mean score, and the common type (COMPOSITE when they differ)."""
    if not feedbacks:
        raise ValueError("nothing to combine")
    if len(feedbacks) == 1:
        return feedbacks[0]
    sources = sources or [f"consumer {i + 1}" for i in range(len(feedbacks))]
    kinds = {f.feedback_type for f in feedbacks}
    content = "\n\n".join(f"[via {src}] {f.content}" for src, f in zip(sources, feedbacks, strict=True))
    return Feedback(
        content,
        mean_score(feedbacks),
        kinds.pop() if len(kinds) == 1 else FeedbackType.COMPOSITE,
        {"combined_from": list(sources)},
    )
