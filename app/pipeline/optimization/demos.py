"""Few-shot demonstrations for training: attach them to every LLM call of a pipeline, and find candidates.

Candidates come from two sources (an optimizer chooses among them; these functions only collect):

* traces: in a forward record whose example passed the metric, every LLM call's input and actual output
  (MIPROv2's bootstrapped demonstrations);
* labels: where an LLM call's output is the pipeline's output (or one field of it) and its input is known before
  any LLM runs (the pipeline's input, or text rendered from it), the labelled example's input and its target
  (DSPy's LabeledFewShot), so that training can start even when the starting prompt gets nothing right.

Both take the examples they are given and nothing else: pass the training split only, never the validation or
test split, or the score measured on those would be measured on demonstrations the model was shown.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.pipeline.demonstrations import Demonstrations, as_text
from app.pipeline.execution.node_runner import is_embedding_call
from app.pipeline.graph import GraphNode, InferenceGraph, InputNode, OpNode
from app.pipeline.llm import LLMInference
from app.pipeline.optimization.training import Example, as_example
from app.pipeline.tracing.tracer import Tracer
from app.pipeline.values import Value, ValueKind, ValueRef


@dataclass(frozen=True)
class DemoCandidate:
    """One possible demonstration of the LLM call at ``call`` (its module path from the pipeline's root)."""

    call: str
    input: Any
    output: Any
    source: str  # "trace" (an actual output that passed) or "label" (the example's target)
    example: int | None = None  # index of the example it came from, in the sequence given
    score: float | None = None  # the example's score (traces)

    def demo(self) -> dict[str, Any]:
        """As a ``Demonstrations`` entry."""
        return {"input": self.input, "output": self.output}


def attach_demonstrations(module: Any) -> dict[str, Demonstrations]:
    """Give every LLMInference of ``module`` a learnable ``demos`` parameter (an empty list) unless it has one
    (declared by the pipeline, or attached before), and return them all by the call's module path. Attached ones
    are named ``<path>.demos`` in ``state_dict()``, and ``load_state_dict`` attaches them again on a fresh
    instance, so a parameter version saves and restores them."""
    return {path: call.attach_demos() for path, call in llm_calls(module)}


def llm_calls(module: Any) -> Iterator[tuple[str, LLMInference]]:
    """``(module path, call)`` of every LLMInference in the module tree, the root included."""
    for path, child in module.named_modules():
        if isinstance(child, LLMInference):
            yield path, child


# -- (a) from traces that passed -------------------------------------------------------------------------------
def candidates_from_traces(
    outputs: Sequence[Any], scores: Sequence[float | None], *, threshold: float = 1.0
) -> dict[str, list[DemoCandidate]]:
    """Per LLM call, the (input, output) of each call in the forward records of the examples whose score reached
    ``threshold``. ``outputs`` are training-mode outputs (``TracedOutput``) or ``ForwardRecord``s, aligned with
    ``scores`` (e.g. ``TrainingStep.scores`` or ``EvaluationResult.scores``); an output without a record, a
    failed call and a call whose input is a whole message list are left out. Repeated inputs count once."""
    found: dict[str, list[DemoCandidate]] = {}
    seen: set[tuple[str, str]] = set()
    for index, (output, score) in enumerate(zip(outputs, scores, strict=True)):
        record = getattr(output, "record", output)
        graph, values = getattr(record, "graph", None), getattr(record, "node_values", None)
        if score is None or score < threshold or graph is None or values is None:
            continue
        for node in _llm_nodes(graph):
            given, answer = _prompt_arg(node), values.get(node.id)
            prompt = _known(given, values)
            if answer is None or answer.kind is ValueKind.ERROR or prompt is None or _is_messages(prompt):
                continue
            key = (node.module_path, as_text(prompt))
            if key not in seen:
                seen.add(key)
                found.setdefault(node.module_path, []).append(
                    DemoCandidate(node.module_path, prompt, answer.payload, "trace", index, score))
    return found


# -- (b) from labelled examples ---------------------------------------------------------------------------------
def candidates_from_examples(module: Any, examples: Sequence[Any]) -> dict[str, list[DemoCandidate]]:
    """Per LLM call whose output is the pipeline's output (or a field of a dict output), the example's input to
    that call and its target (or the target's field) for every example with a target. The call's input must be
    computable without running an LLM (the pipeline's input, or ``F`` ops on it): the module is traced on each
    example, which runs no LLM. Repeated inputs count once."""
    found: dict[str, list[DemoCandidate]] = {}
    seen: set[tuple[str, str]] = set()
    for index, item in enumerate(examples):
        example: Example = as_example(item)
        if example.target is None:
            continue
        graph = Tracer().trace_values(module, *example.args, **example.kwargs)
        for node_id, target in _output_targets(graph.output_structure, example.target):
            node = graph.nodes[node_id]
            if not _chat_call(node):
                continue
            prompt = _static_input(graph, node)
            if prompt is None or _is_messages(prompt):
                continue
            key = (node.module_path, as_text(prompt))
            if key not in seen:
                seen.add(key)
                found.setdefault(node.module_path, []).append(
                    DemoCandidate(node.module_path, prompt, target, "label", index))
    return found


def _llm_nodes(graph: InferenceGraph) -> list[GraphNode]:
    return [graph.nodes[node_id] for node_id in graph.topological_order() if _chat_call(graph.nodes[node_id])]


def _chat_call(node: GraphNode) -> bool:
    """An LLM call that can be shown demonstrations (an Embedding's node is an endpoint call too, but no chat)."""
    return node.kind == "llm" and not is_embedding_call(node)


def _prompt_arg(node: GraphNode) -> Any:
    return node.args[0] if node.args else node.kwargs.get("prompt")


def _known(arg: Any, values: Mapping[str, Value]) -> Any:
    """The payload of a node argument from known values; None when a value it refers to is unknown or an error."""
    try:
        return _payload(arg, values)
    except LookupError:
        return None


def _payload(arg: Any, values: Mapping[str, Value]) -> Any:
    if isinstance(arg, ValueRef):
        value = values.get(arg.ref)
        if value is None or value.kind is ValueKind.ERROR:
            raise LookupError(arg.ref)
        return value.payload
    if isinstance(arg, Value):
        return arg.payload
    if isinstance(arg, dict):
        return {k: _payload(v, values) for k, v in arg.items()}
    if isinstance(arg, list | tuple):
        return type(arg)(_payload(v, values) for v in arg)
    return arg


def _is_messages(payload: Any) -> bool:
    return isinstance(payload, list) and all(isinstance(m, dict) and "role" in m for m in payload)


def _output_targets(structure: Any, target: Any) -> Iterator[tuple[str, Any]]:
    """``(output node id, the part of the target it should produce)`` along the pipeline's output structure."""
    if isinstance(structure, str):
        yield structure, target
    elif isinstance(structure, dict) and isinstance(target, Mapping):
        for key, sub in structure.items():
            if key in target:
                yield from _output_targets(sub, target[key])
    elif isinstance(structure, list | tuple) and isinstance(target, list | tuple) and len(structure) == len(target):
        for sub, part in zip(structure, target, strict=True):
            yield from _output_targets(sub, part)


def _static_input(graph: InferenceGraph, node: GraphNode) -> Any:
    """The call's prompt payload when only inputs and ``F`` ops lead to it (None when an LLM or a Python module
    does, or an op fails)."""
    needed = graph.ancestors(node.id)
    values: dict[str, Value] = {}
    for node_id in graph.topological_order():
        current = graph.nodes[node_id]
        if node_id not in needed or not all(dep in values for dep in current.dependencies):
            continue
        if isinstance(current.module, InputNode) and current.module.value is not None:
            given = current.module.value
            values[node_id] = Value(given.kind, given.payload, node_id, dict(given.meta))
        elif isinstance(current.module, OpNode):
            result = current.module.run(_resolved(current.args, values), _resolved(current.kwargs, values))
            if result.kind is not ValueKind.ERROR:
                values[node_id] = result
    return _known(_prompt_arg(node), values)


def _resolved(obj: Any, values: Mapping[str, Value]) -> Any:
    """Node arguments with their refs replaced by the Values computed for them (every one is known here)."""
    if isinstance(obj, ValueRef):
        return values[obj.ref]
    if isinstance(obj, dict):
        return {k: _resolved(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolved(v, values) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_resolved(v, values) for v in obj)
    return obj
