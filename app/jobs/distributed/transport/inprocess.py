"""The in-process transport: node tasks on asyncio queues in the server, run by the same node-task code as a
Celery worker's (:func:`app.jobs.distributed.run_node`), on a pool of task threads.

This is the embedded mode: no broker, one process. The dispatch windows, the fair share between tenants, the
node store with its leases and attempts, the retries with backoff and the sweeper are the ones workers use; only
the carrier of the messages differs. Messages live in memory, so a server that stops loses them: the rows stay
in the database, and :meth:`InProcessNodes.start` hands every node a previous run of this process left sent or
running back to the dispatch windows (the embedded mode owns its database; workers are not running meanwhile).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from app.jobs.distributed.messages import NodeMessage
from app.jobs.distributed.transport.queues import Queues, route_node
from app.pipeline.resources.config import EndpointConfig

log = logging.getLogger(__name__)

#: runs one delivered message in a task thread (``run_node`` with the message's nodes)
Deliver = Callable[[NodeMessage], None]


class InProcessDispatcher:
    """A :class:`~app.jobs.distributed.messages.Dispatcher` whose queues are in this process: the lowest priority
    value is taken first, then the oldest message; a message with a countdown joins its queue when it is due.
    ``send`` may be called from any thread."""

    def __init__(self, queues: Queues, *, group: int = 1) -> None:
        self.queues = queues
        self.group = group
        self._heap: list[tuple[int, int, NodeMessage]] = []
        self._order = itertools.count()
        self._depth = dict.fromkeys(queues.all(), 0)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._timers: set[threading.Timer] = set()
        self._closed = False

    def route(
        self, *, kind: str, endpoint: EndpointConfig | None, job_priority: int, depth: int
    ) -> tuple[str, int]:
        return route_node(self.queues, kind=kind, endpoint=endpoint, job_priority=job_priority, depth=depth)

    def send(self, messages: Sequence[NodeMessage]) -> None:
        if self._closed:
            raise RuntimeError("the in-process node queue is stopped")
        later = [m for m in messages if m.countdown > 0]
        now = [m for m in messages if m.countdown <= 0]
        with self._lock:
            for m in now:
                self._push(m)
            if now:
                self._ready.notify(len(now))
        for m in later:
            timer = threading.Timer(m.countdown, self._due, args=(m,))
            timer.daemon = True
            with self._lock:
                self._timers.add(timer)
            timer.start()

    def _due(self, message: NodeMessage) -> None:
        with self._lock:
            self._timers.discard(threading.current_thread())  # type: ignore[arg-type]  # this timer fired
            if self._closed:
                return
            self._push(message)
            self._ready.notify()

    def _push(self, message: NodeMessage) -> None:
        heapq.heappush(self._heap, (message.priority, next(self._order), message))
        self._depth[message.queue] = self._depth.get(message.queue, 0) + 1

    def take(self, timeout: float | None = None) -> NodeMessage | None:
        """The next message (blocking up to ``timeout``); None on timeout or once closed."""
        with self._lock:
            if not self._heap and not self._closed:
                self._ready.wait(timeout)
            if self._closed or not self._heap:
                return None
            _, _, message = heapq.heappop(self._heap)
            self._depth[message.queue] -= 1
            return message

    def queue_depth(self, queue: str) -> int:
        with self._lock:
            return self._depth.get(queue, 0)

    def close(self) -> None:
        """Drop the waiting messages (their rows stay queued) and wake every taker."""
        with self._lock:
            self._closed = True
            self._heap.clear()
            self._depth = dict.fromkeys(self._depth, 0)
            timers, self._timers = self._timers, set()
            self._ready.notify_all()
        for timer in timers:
            timer.cancel()


class InProcessNodes:
    """``threads`` task threads taking messages from ``dispatcher`` and running each with ``deliver`` (the node
    task). ``on_done(message)`` runs after each delivery (the server publishes the job's news)."""

    def __init__(
        self,
        dispatcher: InProcessDispatcher,
        deliver: Deliver,
        *,
        threads: int,
        on_done: Callable[[NodeMessage], None] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.deliver = deliver
        self.threads = threads
        self.on_done = on_done
        self._pool: list[threading.Thread] = []
        self._stopping = threading.Event()

    def capacity(self, queue: str) -> int:
        """The nodes that keep every thread busy (each takes from every queue, a message of up to ``group``
        nodes at a time): sizes the dispatch windows, within the endpoints' caps."""
        return self.threads * max(1, self.dispatcher.group)

    def start(self) -> None:
        for n in range(self.threads):
            thread = threading.Thread(target=self._consume, name=f"node-task-{n}", daemon=True)
            thread.start()
            self._pool.append(thread)

    def _consume(self) -> None:
        while not self._stopping.is_set():
            message = self.dispatcher.take(timeout=1.0)
            if message is None:
                continue
            try:
                self.deliver(message)
            except Exception:  # the node's rows say what happened; the sweeper takes over a lost delivery
                log.exception("node task %s/%s/%s failed", message.job_id, message.item_id, message.node_id)
            if self.on_done is not None:
                try:
                    self.on_done(message)
                except Exception:
                    log.exception("the node task's completion hook failed")

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop taking messages and wait for the deliveries running now (their calls are cancelled by the
        caller's event loop shutting down; a delivery that does not end in ``timeout`` is left to its lease)."""
        self._stopping.set()
        self.dispatcher.close()
        pool, self._pool = self._pool, []
        await asyncio.to_thread(_join, pool, timeout)


def _join(threads: list[threading.Thread], timeout: float) -> None:
    for thread in threads:
        thread.join(timeout)


class LoopSubmit:
    """``submit(coro)`` for task threads: schedules the coroutine on ``loop`` (the server's). ``cancel_all()``
    cancels the calls still running at shutdown; their nodes stay claimed until the next start hands them back."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._running: dict[concurrent.futures.Future[Any], str | None] = {}
        self._lock = threading.Lock()
        self._delivery = threading.local()  # the job of the delivery this task thread runs

    def delivering(self, job_id: str | None) -> None:
        """The calling task thread now runs a delivery of ``job_id`` (its calls are tagged with it)."""
        self._delivery.job_id = job_id

    def __call__(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self._lock:
            self._running[future] = getattr(self._delivery, "job_id", None)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._running.pop(future, None)

    def cancel_job(self, job_id: str) -> None:
        """Cancel the running calls of ``job_id`` (it was cancelled): their nodes are given back and the job
        settles at once instead of when its calls end."""
        with self._lock:
            running = [f for f, job in self._running.items() if job == job_id]
        for future in running:
            future.cancel()

    def cancel_all(self) -> None:
        with self._lock:
            running = list(self._running)
        for future in running:
            future.cancel()
