"""One graph node of one item at a time: the functions a distributed worker (a Celery task) calls.

A node task (on a Celery worker or the server's in-process queue) loads an item's graph and its stored node
results, runs one ready node, and stores that node's result idempotently. (A user's own ``run()`` runs whole
items on the pipeline's Scheduler instead; jobs never do.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.db import ItemStatus, repository
from app.db.repository import ItemOutcome
from app.jobs.encoding import decode_item_input, decode_value, encode_value, error_of, to_jsonable
from app.jobs.graphs import load_module, trace_item
from app.pipeline.execution.executor import outputs_of
from app.pipeline.execution.node_runner import resolve_args, run_llm_node, run_module_node
from app.pipeline.execution.state import ExecutionState, TaskResult
from app.pipeline.graph import GraphNode, InferenceGraph, InputNode, OpNode
from app.pipeline.values import Value, first_error_value


@dataclass
class ItemGraph:
    """An item's traced graph with the values known so far (its inputs and every stored node)."""

    job_id: str
    item_id: int
    custom_id: str
    graph: InferenceGraph
    values: dict[str, Value]

    def state(self) -> ExecutionState:
        return ExecutionState(self.graph, execution_id=f"{self.job_id}:{self.custom_id}", preloaded=self.values)

    def dependents(self) -> dict[str, list[str]]:
        """The graph's dependents, computed once per traced graph (a worker keeps recent items' graphs)."""
        cached: dict[str, list[str]] | None = getattr(self.graph, "_dependents", None)
        if cached is None:
            cached = self.graph.dependents()
            self.graph._dependents = cached  # type: ignore[attr-defined]
        return cached

    def arguments(self, node: GraphNode) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The node's resolved arguments from the known values (without building a whole ExecutionState)."""
        return resolve_args(_Known(self, node), node)  # type: ignore[arg-type]


class _Known:
    """What :func:`resolve_args` reads of a state: the results of the node's dependencies."""

    def __init__(self, item: ItemGraph, node: GraphNode) -> None:
        self.results: dict[str, TaskResult] = {}
        for dep in node.dependencies:
            value = item.values.get(dep)
            if value is None:
                module = item.graph.nodes[dep].module
                given = module.value if isinstance(module, InputNode) else None
                if given is None:
                    raise LookupError(f"node {node.id} needs {dep}, whose result is not known")
                value = Value(given.kind, given.payload, dep, dict(given.meta))
            self.results[dep] = TaskResult(dep, value)


def load_item_graph(session: Session, *, item_id: int, module: Any = None) -> ItemGraph:
    """Trace the item's graph (``module``: a loaded pipeline to reuse, else the job's pipeline is loaded) and
    attach the stored results of its nodes."""
    item = repository.get_item_by_id(session, item_id=item_id)
    if item is None:
        raise LookupError(f"no item with id {item_id}")
    job = repository.get_job(session, job_id=item.job_id)
    assert job is not None
    if module is None:
        pipeline = repository.get_pipeline(session, pipeline_id=job.pipeline_id)
        assert pipeline is not None
        module = load_module(job.pipeline_name, pipeline.parameter_state)
    args, kwargs = decode_item_input(item.input)
    graph = trace_item(module, args, kwargs)
    stored = repository.node_values(session, item_ids=[item_id])[item_id]
    values = {node_id: decode_value(v) for node_id, v in stored.items() if node_id in graph.nodes}
    return ItemGraph(job.id, item.id, item.custom_id, graph, values)


async def execute_node(item: ItemGraph, node_id: str, resources: Any, attempt: int = 0) -> TaskResult:
    """Run one node on its stored inputs: the one way a job runs a node, on either transport. An ERROR input
    passes through without running (errors are data); other failures raise, for the caller's retry policy."""
    node = item.graph.nodes[node_id]
    if isinstance(node.module, OpNode):
        return run_op_node(item, node_id, attempt)
    args, kwargs = item.arguments(node)
    start = time.perf_counter()
    failed = first_error_value(*args, **kwargs)
    if failed is not None:
        value = failed
    elif node.kind == "llm":
        value = await run_llm_node(resources, node, args, kwargs)
    else:
        value = await run_module_node(node, args, kwargs)
    return _result(node_id, value, start, attempt)


def run_op_node(item: ItemGraph, node_id: str, attempt: int = 0) -> TaskResult:
    """An ``F.*`` op: synchronous and cheap, so the task that made it ready runs it on the spot (a message round
    trip would cost more than the op)."""
    node = item.graph.nodes[node_id]
    assert isinstance(node.module, OpNode)
    start = time.perf_counter()
    args, kwargs = item.arguments(node)
    failed = first_error_value(*args, **kwargs)
    return _result(node_id, failed if failed is not None else node.module.run(args, kwargs), start, attempt)


def _result(node_id: str, value: Value, start: float, attempt: int) -> TaskResult:
    if value.ref != node_id:
        value = Value(value.kind, value.payload, node_id, dict(value.meta))
    return TaskResult(node_id, value, (time.perf_counter() - start) * 1000.0, attempt)


def store_node_result(session: Session, item: ItemGraph, result: TaskResult) -> bool:
    """Store the node's result (``INSERT ... ON CONFLICT DO NOTHING``) and remember it in ``item``; False when
    another attempt had stored it first, in which case the stored value wins."""
    inserted = repository.insert_node_result(
        session, job_id=item.job_id, item_id=item.item_id, node_id=result.node_id,
        value=encode_value(result.value), duration_ms=round(result.duration_ms, 3), attempt=result.retry_count,
    )
    if inserted:
        item.values[result.node_id] = result.value
    else:
        stored = repository.get_node_result(session, job_id=item.job_id, item_id=item.item_id,
                                            node_id=result.node_id)
        assert stored is not None
        item.values[result.node_id] = decode_value(stored.value)
    return inserted


def item_outcome(item: ItemGraph) -> ItemOutcome | None:
    """The item's terminal outcome once every output node is known, else None."""
    if not all(node_id in item.values or node_id in item.graph.input_ids for node_id in item.graph.output_ids):
        return None
    state = item.state()
    try:
        return ItemOutcome(item.item_id, ItemStatus.COMPLETED, to_jsonable(outputs_of(state)), None)
    except Exception as exc:
        return ItemOutcome(item.item_id, ItemStatus.FAILED, None, error_of(exc))
