"""What backward learns about each Parameter besides its feedback text: where it sits in the recorded graphs
(which learnable parameters feed it, how deep it is) and the scores of the feedback it received.

Kept beside the Parameter (weakly keyed, so it never keeps one alive) rather than on an optimizer: like
``.grad`` in PyTorch, ``await feedback.backward()`` needs no optimizer, and ``optimizer.step()`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    from app.pipeline.parameter import Parameter


@dataclass
class ParamContext:
    upstream: dict[int, Parameter] = field(default_factory=dict)  # id(param) -> param
    depth: int | None = None  # smallest depth of a node using the parameter
    scores: list[float] = field(default_factory=list)


_CONTEXT: WeakKeyDictionary[Parameter, ParamContext] = WeakKeyDictionary()


def context_of(param: Parameter) -> ParamContext:
    ctx = _CONTEXT.get(param)
    if ctx is None:
        ctx = _CONTEXT[param] = ParamContext()
    return ctx


def peek(param: Parameter) -> ParamContext | None:
    return _CONTEXT.get(param)


def note_position(param: Parameter, upstream: list[Parameter], depth: int) -> None:
    ctx = context_of(param)
    for other in upstream:
        if other is not param:
            ctx.upstream[id(other)] = other
    ctx.depth = depth if ctx.depth is None else min(ctx.depth, depth)


def note_score(param: Parameter, score: float | None) -> None:
    if score is not None:
        context_of(param).scores.append(score)


def forget(param: Parameter) -> None:
    _CONTEXT.pop(param, None)
