"""Grouping ready nodes into node-task messages: one job, queue and priority per message, up to ``group``; an
item's nodes side by side, and a node of another item than the first names its item."""

from __future__ import annotations

from app.db.repository.node_tasks import NodeTaskRef
from app.jobs.distributed.node_task import messages_of


def _ref(item: int, node: str, queue: str = "q.llm", priority: int = 5, attempts: int = 0) -> NodeTaskRef:
    return NodeTaskRef("job", item, node, attempts, queue, priority)


def test_one_node_a_message_without_grouping() -> None:
    refs = [_ref(1, "a"), _ref(1, "b")]
    messages = messages_of(refs)
    assert [(m.node_id, m.also) for m in messages] == [("a", ()), ("b", ())]


def test_nodes_of_one_queue_and_priority_share_a_message_across_items() -> None:
    refs = [_ref(1, "a"), _ref(2, "a"), _ref(1, "b", attempts=2), _ref(1, "c", queue="q.cpu"), _ref(1, "d", priority=3)]
    messages = messages_of(refs, group=4)
    assert [(m.item_id, m.node_id, m.also, m.queue, m.priority) for m in messages] == [
        (1, "a", (("b", 2), ("a", 0, 2)), "q.llm", 5),
        (1, "c", (), "q.cpu", 5),
        (1, "d", (), "q.llm", 3),
    ]
    assert sum(m.nodes for m in messages) == len(refs)


def test_jobs_never_share_a_message() -> None:
    refs = [_ref(1, "a"), NodeTaskRef("other", 2, "a", 0, "q.llm", 5)]
    assert [m.job_id for m in messages_of(refs, group=4)] == ["job", "other"]


def test_a_group_holds_at_most_group_nodes() -> None:
    refs = [_ref(1, f"n{i}") for i in range(5)]
    messages = messages_of(refs, group=2)
    assert [m.nodes for m in messages] == [2, 2, 1]
    assert [m.node_id for m in messages] == ["n0", "n2", "n4"]
