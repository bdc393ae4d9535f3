"""Pipelines as the job layer sees them: load the module, trace an item, and the graph's stored forms."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from app.jobs.registry import UnknownPipelineError, load_pipeline, resolve_pipeline_path
from app.pipeline.graph import InferenceGraph
from app.pipeline.tracing.tracer import Tracer
from app.pipeline.values import valueify


def load_module(name: str, parameter_state: dict[str, Any] | None = None) -> Any:
    """A fresh instance of the named pipeline with the registered parameter values applied."""
    module = load_pipeline(name)
    if parameter_state:
        try:
            module.load_state_dict(parameter_state)
        except KeyError as exc:
            raise UnknownPipelineError(
                f"the stored parameters of {name!r} do not fit its current code ({exc}); register new ones"
            ) from None
    return module


def import_path_of(name: str) -> str:
    return resolve_pipeline_path(name)


def trace_item(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InferenceGraph:
    return Tracer().trace_values(module, *args, **kwargs)


def with_inputs(graph: InferenceGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InferenceGraph | None:
    """``graph`` with its input nodes bound to ``args`` and ``kwargs`` instead (bound as tracing binds them);
    None when they do not make the same input nodes."""
    tracer = Tracer()
    tracer.reset()
    for arg in args:
        tracer.bind_inputs(valueify(arg))
    for key, arg in kwargs.items():
        tracer.bind_inputs(valueify(arg), f"input_{key}")
    if tracer.input_ids != graph.input_ids:
        return None
    nodes = dict(graph.nodes)
    nodes.update(tracer.nodes)  # the input nodes keep their places
    return InferenceGraph(
        nodes, list(graph.input_ids), list(graph.output_ids), graph.output_structure, graph.parameters
    )


class ShapeGraphs:
    """Items' traced graphs, one trace per scope (a job) and input shape: items of one shape trace to one graph
    but for the values of its input nodes (submission stores one graph per shape on that ground), so an item's
    graph is its shape's with the item's inputs bound (:func:`with_inputs`), at a fraction of a trace's cost.

    The second item of a shape is traced anyway and must come out exactly as binding makes it (its whole graph
    document, every node's arguments and configuration included); if not, that shape is traced item by item from
    then on: a pipeline whose graph depends on its inputs' values is not given another item's graph."""

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        # (scope, shape) -> [graph, checked]; None: traced item by item
        self._shapes: OrderedDict[Any, list[Any] | None] = OrderedDict()
        self._lock = threading.Lock()

    def graph(self, scope: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InferenceGraph:
        key = (scope, shape_key((args, kwargs)))
        with self._lock:
            entry = self._shapes.get(key, _UNSEEN)
            if entry is not _UNSEEN:
                self._shapes.move_to_end(key)
        if entry is not None and entry is not _UNSEEN and entry[1]:
            bound = with_inputs(entry[0], args, kwargs)
            if bound is not None:
                return bound
        graph = trace_item(module, args, kwargs)
        if entry is None:
            return graph
        if entry is _UNSEEN:
            self._remember(key, [graph, False])
        else:  # the second item of the shape: binding must make exactly what tracing made
            bound = with_inputs(entry[0], args, kwargs)
            same = bound is not None and bound.to_dict() == graph.to_dict()
            self._remember(key, [entry[0], True] if same else None)
        return graph

    def _remember(self, key: Any, entry: list[Any] | None) -> None:
        with self._lock:
            self._shapes[key] = entry
            self._shapes.move_to_end(key)
            while len(self._shapes) > self._limit:
                self._shapes.popitem(last=False)


_UNSEEN: Any = object()


def shape_key(obj: Any) -> Any:
    """The structure of an input with its leaves reduced to type names: items with the same shape trace to the
    same graph, so submission traces one item per shape."""
    if isinstance(obj, dict):
        return ("dict", tuple((str(k), shape_key(v)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, tuple(shape_key(v) for v in obj))
    return type(obj).__name__


def graph_forms(graph: InferenceGraph) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """``(hash, document, node rows)``: the graph's JSON without the traced item's input values (the pipeline's
    graph, not one item's), and one row per node for the graph_nodes table."""
    document = graph.to_dict()
    depth = graph.depth()
    rows = []
    for node in document["nodes"]:
        node.pop("value", None)
        rows.append(
            {
                "node_id": node["id"],
                "kind": node["kind"],
                "type": node["type"],
                "module_path": node["module_path"],
                "alias": graph.nodes[node["id"]].alias,
                "dependencies": list(node["dependencies"]),
                "priority": node["priority"],
                "depth": depth[node["id"]],
            }
        )
    return document["hash"], document, rows
