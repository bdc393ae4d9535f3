"""How a traced graph becomes node tasks: what each node waits for, where it goes, and at which priority."""

from __future__ import annotations

import pytest

from app.jobs.distributed.dispatch import missing_aliases, plan_graph
from app.jobs.distributed.messages import Endpoints
from app.jobs.distributed.transport.celery_dispatch import CeleryDispatcher
from app.jobs.distributed.transport.queues import Queues
from app.jobs.graphs import graph_forms, trace_item
from app.pipeline.resources.config import EndpointConfig, ResourceConfig


class _Routes(CeleryDispatcher):
    def __init__(self) -> None:  # routing only: no Celery app, no Redis
        self.queues = Queues.from_prefix("t")


def _fan_out_rows() -> list[dict[str, object]]:
    from app.examples.review_compare import ReviewCompare

    _, _, rows = graph_forms(trace_item(ReviewCompare(), ("a long review",), {}))
    return rows


def test_each_node_waits_for_its_runnable_dependencies_once() -> None:
    rows = _fan_out_rows()
    plans = {p.node_id: p for p in plan_graph(rows, Endpoints(None), _Routes(), job_priority=0)}
    kinds = {r["node_id"]: r["kind"] for r in rows}
    assert not any(kinds[n] == "input" for n in plans)  # inputs are never run
    waiting = {kinds[n] + ":" + str(p.waiting) for n, p in plans.items()}
    assert waiting == {"llm:0", "op:2", "llm:1"}  # two extractions, the render waits for both, the verdict for it
    roots = [p for p in plans.values() if p.waiting == 0]
    assert len(roots) == 2 and {p.queue for p in roots} == {"t.engine"}  # no resources: the in-process engine
    assert {p.priority for p in roots} == {5}
    assert next(p for p in plans.values() if p.kind == "op").queue == "t.cpu"


def test_a_dependency_named_twice_counts_once() -> None:
    rows = [
        {"node_id": "in", "kind": "input", "dependencies": [], "depth": 0},
        {"node_id": "a", "kind": "op", "dependencies": ["in"], "depth": 1},
        {"node_id": "b", "kind": "op", "dependencies": ["a", "a", "in"], "depth": 2},
    ]
    plans = {p.node_id: p for p in plan_graph(rows, Endpoints(None), _Routes(), job_priority=2)}
    assert plans["a"].waiting == 0 and plans["b"].waiting == 1
    assert plans["a"].priority == 7 and plans["b"].priority == 6  # the job's priority, minus the depth boost


@pytest.mark.parametrize(
    ("endpoint", "queue"),
    [
        (EndpointConfig("openai", "gpt-4o-mini", base_url="http://127.0.0.1:9/v1"), "t.llm"),
        (EndpointConfig("native", "smol"), "t.engine"),
        (EndpointConfig("native", "smol", base_url="http://gpu-box:8000/v1"), "t.llm"),
    ],
)
def test_llm_nodes_go_where_their_alias_resolves(endpoint: EndpointConfig, queue: str) -> None:
    endpoints = Endpoints(ResourceConfig({"assistant": endpoint}))
    plans = plan_graph(_fan_out_rows(), endpoints, _Routes(), job_priority=0)
    assert {p.queue for p in plans if p.kind == "llm"} == {queue}


def test_aliases_missing_from_the_resources_file_are_named() -> None:
    rows = _fan_out_rows()
    assert missing_aliases(rows, Endpoints(None)) == []  # no file: the in-process engine serves every alias
    other = Endpoints(ResourceConfig({"judge": EndpointConfig("openai", "gpt-4o")}))
    assert missing_aliases(rows, other) == ["assistant"]
