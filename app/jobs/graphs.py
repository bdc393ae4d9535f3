"""Pipelines as the job layer sees them: load the module, trace an item, and the graph's stored forms."""

from __future__ import annotations

from typing import Any

from app.jobs.registry import UnknownPipelineError, load_pipeline, resolve_pipeline_path
from app.pipeline.graph import InferenceGraph
from app.pipeline.tracing.tracer import Tracer


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
