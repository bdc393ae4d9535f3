"""Routing by node kind, message priority and task ids (pure functions, no Redis)."""

from __future__ import annotations

import pytest

from app.jobs.distributed.transport.queues import (
    DEFAULT_QUEUES,
    Queues,
    node_task_id,
    priority_for,
    queue_for,
)


def test_queues_are_named_by_prefix() -> None:
    assert DEFAULT_QUEUES.all() == ("inf.cpu", "inf.llm", "inf.engine")
    queues = Queues.from_prefix("t1")
    assert (queues.resolve("cpu"), queues.resolve("engine"), queues.resolve("other.q")) == (
        "t1.cpu",
        "t1.engine",
        "other.q",
    )


@pytest.mark.parametrize("kind", ["input", "op", "module"])
def test_plain_python_nodes_go_to_the_cpu_queue(kind: str) -> None:
    assert queue_for(kind) == "inf.cpu"
    assert queue_for(kind, provider="native") == "inf.cpu"  # the endpoint only matters for LLM nodes


def test_llm_nodes_go_to_the_engine_only_when_it_is_in_process() -> None:
    assert queue_for("llm", provider="native") == "inf.engine"
    assert queue_for("llm", provider="native", base_url="http://gpu-box:8000/v1") == "inf.llm"
    assert queue_for("llm", provider="openai", base_url="https://api.openai.com/v1") == "inf.llm"
    assert queue_for("llm", provider="vllm") == "inf.llm"
    assert queue_for("llm", provider="native", queues=Queues.from_prefix("t")) == "t.engine"


def test_an_unknown_node_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown node kind 'gpu'"):
        queue_for("gpu")


def test_deeper_nodes_run_before_new_items_of_the_same_job() -> None:
    levels = [priority_for(0, depth) for depth in range(6)]
    assert levels == [6, 5, 4, 3, 3, 3]  # lower runs sooner; the boost stops after three levels
    # an item's second node overtakes every first node of the same job
    assert priority_for(0, 1) < priority_for(0, 0)


def test_job_priority_moves_every_node_and_stays_in_range() -> None:
    assert priority_for(-2, 0) == 4  # more urgent job: lower level
    assert priority_for(2, 0) == 8
    assert priority_for(-100, 5) == 0
    assert priority_for(100, 0) == 9
    with pytest.raises(ValueError, match="node_depth"):
        priority_for(0, -1)


def test_node_task_ids_are_deterministic_and_bounded() -> None:
    assert node_task_id("job1", 3, "LLMInference_0", 0) == "job1:3:LLMInference_0:0"
    assert node_task_id("job1", 3, "LLMInference_0", 1) != node_task_id("job1", 3, "LLMInference_0", 0)
    long = node_task_id("job1", "item", "Very" * 100, 2)
    assert long == node_task_id("job1", "item", "Very" * 100, 2)
    assert long.startswith("job1:") and long.endswith(":2") and len(long) < 80
