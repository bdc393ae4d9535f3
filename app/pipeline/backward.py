"""Records exchanged during backward: what a module receives and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BackwardContext:
    """What a module's ``backward`` sees for one node: its inputs (by forward's parameter names, resolved to the
    Values of the forward pass), its output, the graph and all node values, the feedback each consumer sent, the
    optimizer's reasoning LLM (``await ctx.reasoning_llm(prompt) -> str``, None unless configured), the module
    and the forward record."""

    node_id: str
    inputs: dict[str, Any] = field(default_factory=dict)
    output: Any = None
    graph: Any = None
    all_results: dict[str, Any] = field(default_factory=dict)
    downstream_feedback: list[Any] = field(default_factory=list)
    reasoning_llm: Any = None
    module: Any = None
    record: Any = None

    def input_names(self) -> list[str]:
        return list(self.inputs)


@dataclass
class BackwardResult:
    """Feedback for each input (keyed like ``BackwardContext.inputs``; a Feedback or a string) and for each
    parameter (by name: dotted from the root, or relative to the module)."""

    input_feedback: dict[str, Any] = field(default_factory=dict)
    parameter_feedback: dict[str, str] = field(default_factory=dict)
