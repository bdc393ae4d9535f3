"""The in-process transport of node tasks: priority order, countdowns, queue depths, closing, and task threads that
run each message once."""

from __future__ import annotations

import threading
import time

import pytest

from app.jobs.distributed.messages import NodeMessage
from app.jobs.distributed.transport.inprocess import InProcessDispatcher, InProcessNodes
from app.jobs.distributed.transport.queues import Queues
from app.pipeline.resources.config import EndpointConfig

QUEUES = Queues.from_prefix("t")


def _message(node: str, priority: int = 6, queue: str = QUEUES.llm, countdown: float = 0.0) -> NodeMessage:
    return NodeMessage("job", 1, node, 0, queue, priority, countdown)


def test_lower_priority_values_are_taken_first_then_the_oldest() -> None:
    dispatcher = InProcessDispatcher(QUEUES)
    dispatcher.send([_message("late", 6), _message("urgent", 2), _message("later", 6)])
    assert dispatcher.queue_depth(QUEUES.llm) == 3 and dispatcher.queue_depth(QUEUES.cpu) == 0
    taken = [dispatcher.take(0) for _ in range(3)]
    assert [m.node_id for m in taken if m is not None] == ["urgent", "late", "later"]
    assert dispatcher.take(0) is None and dispatcher.queue_depth(QUEUES.llm) == 0


def test_a_countdown_delays_a_message_until_it_is_due() -> None:
    dispatcher = InProcessDispatcher(QUEUES)
    dispatcher.send([_message("retry", countdown=0.2)])
    assert dispatcher.take(0.05) is None
    message = dispatcher.take(2.0)
    assert message is not None and message.node_id == "retry"


def test_routing_is_the_celery_transports() -> None:
    dispatcher = InProcessDispatcher(QUEUES)
    remote = EndpointConfig("openai", "m", base_url="http://127.0.0.1:9/v1")
    assert dispatcher.route(kind="llm", endpoint=remote, job_priority=0, depth=0) == (QUEUES.llm, 6)
    assert dispatcher.route(kind="llm", endpoint=EndpointConfig("native", "m"), job_priority=0, depth=1)[0] == \
        QUEUES.engine
    assert dispatcher.route(kind="op", endpoint=None, job_priority=-1, depth=3) == (QUEUES.cpu, 2)


def test_a_closed_queue_refuses_messages_and_wakes_takers() -> None:
    dispatcher = InProcessDispatcher(QUEUES)
    dispatcher.send([_message("dropped")])
    woke: list[object] = []
    taker = threading.Thread(target=lambda: woke.append(dispatcher.take(10.0)))
    dispatcher.close()
    taker.start()
    taker.join(2.0)
    assert woke == [None] and dispatcher.queue_depth(QUEUES.llm) == 0
    with pytest.raises(RuntimeError, match="stopped"):
        dispatcher.send([_message("late")])


async def test_task_threads_run_every_message_once_and_size_the_windows() -> None:
    dispatcher = InProcessDispatcher(QUEUES, group=4)
    ran: list[str] = []
    lock = threading.Lock()

    def deliver(message: NodeMessage) -> None:
        time.sleep(0.01)
        with lock:
            ran.append(message.node_id)

    done: list[str] = []
    nodes = InProcessNodes(dispatcher, deliver, threads=4, on_done=lambda m: done.append(m.node_id))
    assert nodes.capacity(QUEUES.llm) == 16  # four threads, four nodes a message
    nodes.start()
    dispatcher.send([_message(f"n{i}") for i in range(40)])
    deadline = time.monotonic() + 10
    while len(ran) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    await nodes.stop()
    assert sorted(ran) == sorted(f"n{i}" for i in range(40)) and sorted(done) == sorted(ran)
