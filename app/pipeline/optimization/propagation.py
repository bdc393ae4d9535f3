"""Backward through a recorded forward pass.

The loss's feedback enters at the graph's outputs. Nodes are visited in reverse topological order (a node runs
once every consumer of its output has sent its feedback; independent nodes run concurrently): the feedback a
node received from several consumers (fan-out) is combined, its module's ``backward(feedback, ctx)`` says what
each input and each parameter should hear, input feedback flows on to the producing nodes, and parameter
feedback accumulates into the Parameters for the optimizer's next ``step()``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any

import app.pipeline.optimization.state as state
from app.pipeline.backward import BackwardContext, BackwardResult
from app.pipeline.optimization.feedback import (
    BackwardPass,
    BackwardReport,
    Feedback,
    as_feedback,
    combine_feedback,
)
from app.pipeline.parameter import Parameter
from app.pipeline.values import Value, ValueRef

if TYPE_CHECKING:
    from app.pipeline.execution.executor import ForwardRecord
    from app.pipeline.graph import GraphNode


async def propagate(feedback: Feedback, optimizer: Any = None) -> BackwardReport:
    """Send each output's own feedback back through its record (a batch's items through theirs)."""
    pairs: list[tuple[ForwardRecord, Feedback]] = []
    for item in feedback.items:
        pairs.extend((record, item) for record in item.records)
    covered = {id(record) for record, _ in pairs}
    pairs.extend((record, feedback) for record in feedback._records if id(record) not in covered)
    reasoning = getattr(optimizer, "reasoning_llm", None)
    if optimizer is not None and hasattr(optimizer, "capture_record"):
        for record, _ in pairs:
            optimizer.capture_record(record)
    passes = await asyncio.gather(*(backward_through(record, fb, reasoning) for record, fb in pairs))
    return BackwardReport(list(passes))


async def backward_through(record: ForwardRecord, feedback: Feedback, reasoning_llm: Any = None) -> BackwardPass:
    graph = record.graph
    params = _ParameterIndex(record)
    _note_positions(record, params)
    report = BackwardPass()
    order = graph.topological_order()
    rank = {node_id: i for i, node_id in enumerate(order)}
    dependents = graph.dependents()
    waiting = {node_id: len(set(dependents[node_id])) for node_id in order}
    incoming: dict[str, list[tuple[str, Feedback]]] = {}
    for out_id in graph.output_ids:
        incoming.setdefault(out_id, []).append(("loss", feedback))

    ready = sorted((n for n, count in waiting.items() if count == 0), key=rank.__getitem__, reverse=True)
    while ready:
        wave = [n for n in ready if incoming.get(n) and graph.nodes[n].kind != "input"]
        for node_id in ready:
            if incoming.get(node_id):
                # consumers in forward order, so a combined feedback reads the same on every run
                received = incoming[node_id] = sorted(incoming[node_id], key=lambda sf: rank.get(sf[0], -1))
                report.node_feedback[node_id] = combine_feedback([f for _, f in received], [s for s, _ in received])
        results = await asyncio.gather(
            *(_node_backward(graph.nodes[n], report.node_feedback[n], incoming[n], record, reasoning_llm)
              for n in wave)
        )
        for node_id, (result, routes) in zip(wave, results, strict=True):
            report.order.append(node_id)
            _route(node_id, graph.nodes[node_id], result, routes, report.node_feedback[node_id], incoming, params,
                   report)
        next_ready: list[str] = []
        for node_id in ready:
            for dep in dict.fromkeys(graph.nodes[node_id].dependencies):
                waiting[dep] -= 1
                if waiting[dep] == 0:
                    next_ready.append(dep)
        ready = sorted(next_ready, key=rank.__getitem__, reverse=True)
    return report


# -- one node ---------------------------------------------------------------------------------------------------
Routes = dict[str, list[tuple[str, dict[str, Any]]]]  # input name -> (ref, meta) of each traced value inside


async def _node_backward(
    node: GraphNode,
    feedback: Feedback,
    received: list[tuple[str, Feedback]],
    record: ForwardRecord,
    reasoning_llm: Any,
) -> tuple[BackwardResult, Routes]:
    inputs, routes = _node_inputs(node, record.node_values)
    ctx = BackwardContext(
        node_id=node.id,
        inputs=inputs,
        output=record.node_values.get(node.id),
        graph=record.graph,
        all_results=record.node_values,
        downstream_feedback=[f for _, f in received],
        reasoning_llm=reasoning_llm,
        module=node.module,
        record=record,
    )
    module = node.module
    backward = getattr(module, "backward", None)
    if backward is None:  # F ops and modules of a graph loaded without its root: feedback passes through
        return BackwardResult(input_feedback=dict.fromkeys(inputs, feedback)), routes
    result = await backward(feedback, ctx)
    if not isinstance(result, BackwardResult):
        raise TypeError(f"{type(module).__name__}.backward must return a BackwardResult, got {type(result).__name__}")
    if _uses_default_backward(module):
        # a plain-Python leaf module that owns learnable parameters: tell them how its output fared
        for param in _learnable(module):
            result.parameter_feedback.setdefault(
                param.name or param.ref, parameter_feedback_text(param, node, feedback, inputs, ctx.output)
            )
    return result, routes


def _uses_default_backward(module: Any) -> bool:
    from app.pipeline.module import Module

    return isinstance(module, Module) and type(module).backward is Module.backward


def _learnable(module: Any) -> list[Parameter]:
    parameters = getattr(module, "parameters", None)
    if parameters is None:
        return []
    return [p for p in parameters() if p.requires_grad]


def _node_inputs(node: GraphNode, values: dict[str, Value]) -> tuple[dict[str, Any], Routes]:
    """The node's inputs by name (forward's parameter names where known) with the refs each one carries."""
    names = _positional_names(node.module, len(node.args))
    inputs: dict[str, Any] = {}
    routes: Routes = {}
    for name, arg in [*zip(names, node.args, strict=True), *node.kwargs.items()]:
        inputs[name] = _resolve(arg, values)
        routes[name] = _refs_in(arg)
    return inputs, routes


def _positional_names(module: Any, count: int) -> list[str]:
    fallback = [f"arg_{i}" for i in range(count)]
    forward = getattr(module, "forward", None)
    if forward is None:
        return fallback
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return fallback
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [positional[i] if i < len(positional) else fallback[i] for i in range(count)]


def _resolve(obj: Any, values: dict[str, Value]) -> Any:
    if isinstance(obj, ValueRef):
        return values.get(obj.ref)
    if isinstance(obj, dict):
        return {k: _resolve(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve(v, values) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_resolve(v, values) for v in obj)
    return obj


def _refs_in(obj: Any) -> list[tuple[str, dict[str, Any]]]:
    found: dict[str, dict[str, Any]] = {}

    def visit(item: Any) -> None:
        if isinstance(item, ValueRef):
            found.setdefault(item.ref, {})
        elif isinstance(item, Value):
            if item.ref is not None:
                found.setdefault(item.ref, dict(item.meta))
        elif isinstance(item, dict):
            for v in item.values():
                visit(v)
        elif isinstance(item, list | tuple):
            for v in item:
                visit(v)

    visit(obj)
    return list(found.items())


def _route(
    node_id: str,
    node: GraphNode,
    result: BackwardResult,
    routes: Routes,
    feedback: Feedback,
    incoming: dict[str, list[tuple[str, Feedback]]],
    params: _ParameterIndex,
    report: BackwardPass,
) -> None:
    for name, sent in result.input_feedback.items():
        if name not in routes:
            raise ValueError(
                f"{node.module_name or node_id}.backward returned feedback for an input named {name!r}, but its "
                f"inputs are {sorted(routes)}"
            )
        fb = as_feedback(sent, feedback)
        for ref, meta in routes[name]:
            if ref in node.dependencies:
                incoming.setdefault(ref, []).append((node_id, fb))
            elif ref.startswith("param:"):
                # a Parameter passed as an argument (e.g. a template given to F.render) learns from its consumer
                param = params.by_meta(meta, ref)
                if param is not None and param.requires_grad:
                    text = parameter_feedback_text(param, node, fb, {name: param.value}, None)
                    _accumulate(param, text, fb, report)
    for key, text in result.parameter_feedback.items():
        param = params.find(key, node.module)
        if param is None:
            raise ValueError(
                f"{node.module_name or node_id}.backward wrote feedback for a parameter {key!r} that is neither "
                f"its module's nor the pipeline's; known: {sorted(params.names())}"
            )
        _accumulate(param, str(text), feedback, report)


def _accumulate(param: Parameter, text: str, feedback: Feedback, report: BackwardPass) -> None:
    if not param.requires_grad or not text:
        return
    param.accumulate_feedback(text)
    state.note_score(param, feedback.score)
    report.parameter_feedback.setdefault(param.name or param.ref, []).append(text)


_QUOTE = 800


def _short(value: Any) -> str:
    text = str(getattr(value, "payload", value))
    return text if len(text) <= _QUOTE else text[:_QUOTE] + f"... [{len(text) - _QUOTE} more characters]"


def parameter_feedback_text(param: Parameter, node: GraphNode, feedback: Feedback, inputs: dict[str, Any],
                            output: Any) -> str:
    """Parameter feedback for a module without its own rule: the value, what it is for, what went in and out,
    and what the consumer said."""
    lines = [
        f"Parameter: {param.name}",
        f"Description: {param.description}",
        f"Current value: {_short(param.value)}",
        f"Used by: {node.module_name or node.id}",
    ]
    lines += [f"Input {name}: {_short(value)}" for name, value in inputs.items()]
    if output is not None:
        lines.append(f"Output: {_short(output)}")
    lines.append(f"Score: {feedback.score if feedback.score is not None else 'n/a'}")
    lines.append(f"Feedback: {_short(feedback.content)}")
    return "\n".join(lines)


# -- parameters of a record ---------------------------------------------------------------------------------------
class _ParameterIndex:
    """Finds the Parameter behind a name (dotted from the root, or relative to a node's module) or a
    ``param:`` ref in a record."""

    def __init__(self, record: ForwardRecord) -> None:
        root = record.module
        self.by_name: dict[str, Parameter] = {}
        self.by_id: dict[str, Parameter] = {}
        named = getattr(root, "named_parameters", None)
        if named is not None:
            for name, param in named():
                self._add(name, param)
        for name, param in record.graph.parameters.items():
            if isinstance(param, Parameter):
                self._add(name, param)

    def _add(self, name: str, param: Parameter) -> None:
        self.by_name.setdefault(name, param)
        if param.name:
            self.by_name.setdefault(param.name, param)
        self.by_id[param._id] = param

    def names(self) -> list[str]:
        return list(self.by_name)

    def find(self, key: str, module: Any) -> Parameter | None:
        named = getattr(module, "named_parameters", None)
        if named is not None:
            for name, param in named():
                if key in (name, param.name, param.ref):
                    self.by_id.setdefault(param._id, param)
                    return param
        return self.by_name.get(key.removeprefix("param:"))

    def by_meta(self, meta: dict[str, Any], ref: str) -> Parameter | None:
        param_id = meta.get("param_id")
        if param_id in self.by_id:
            return self.by_id[param_id]
        return self.by_name.get(meta.get("param_name") or ref.removeprefix("param:"))

    def of_node(self, node: GraphNode) -> list[Parameter]:
        """Learnable parameters a node uses: its module's, and any passed to it as arguments."""
        found: dict[int, Parameter] = {id(p): p for p in _learnable(node.module)}
        for arg in [*node.args, *node.kwargs.values()]:
            for ref, meta in _refs_in(arg):
                if ref.startswith("param:"):
                    param = self.by_meta(meta, ref)
                    if param is not None and param.requires_grad:
                        found[id(param)] = param
        return list(found.values())


def _note_positions(record: ForwardRecord, params: _ParameterIndex) -> None:
    """Remember which learnable parameters feed which (for the optimizer's ordered updates)."""
    graph = record.graph
    node_params = {node_id: params.of_node(node) for node_id, node in graph.nodes.items()}
    holders = [node_id for node_id, found in node_params.items() if found]
    if not holders:
        return
    depth = graph.depth()
    for node_id in holders:
        ancestors = graph.ancestors(node_id)
        upstream = [p for other in holders if other in ancestors for p in node_params[other]]
        for param in node_params[node_id]:
            state.note_position(param, upstream, depth[node_id])
