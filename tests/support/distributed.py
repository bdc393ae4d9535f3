"""An in-process stand-in for the Celery transport: messages kept in a list, run by a thread pool through the very
function the Celery task calls (``run_node``), on one shared event loop as in a worker process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from app.db import make_session_factory, session_scope
from app.db.direct import DirectPool
from app.db.models import NodeTask
from app.jobs.distributed import Endpoints, NodeCall, NodeMessage, NodePolicy, NodeWorker, Outcome, run_node
from app.jobs.distributed.transport.queues import Queues, node_task_id, priority_for, queue_for
from app.jobs.submission import JobRequest, submit_job
from app.pipeline.resources.config import EndpointConfig
from workers.engine_host import LoopHost


@dataclass
class ListDispatcher:
    """Routes like the Celery dispatcher; ``sent`` keeps every message in order."""

    queues: Queues = field(default_factory=lambda: Queues.from_prefix("t"))
    sent: list[NodeMessage] = field(default_factory=list)
    pending: list[NodeMessage] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    fail_sends: int = 0

    def route(
        self, *, kind: str, endpoint: EndpointConfig | None, job_priority: int, depth: int
    ) -> tuple[str, int]:
        provider = endpoint.provider if endpoint is not None else None
        base_url = endpoint.base_url if endpoint is not None else None
        return queue_for(kind, provider=provider, base_url=base_url, queues=self.queues), priority_for(
            job_priority, depth
        )

    def send(self, messages: Sequence[NodeMessage]) -> None:
        with self.lock:
            if self.fail_sends:
                self.fail_sends -= 1
                raise ConnectionError("broker down (scripted)")
            self.sent.extend(messages)
            self.pending.extend(messages)

    def queue_depth(self, queue: str) -> int:
        with self.lock:
            return sum(1 for m in self.pending if m.queue == queue)

    def take(self) -> list[NodeMessage]:
        with self.lock:
            taken, self.pending = self.pending, []
            return taken


def make_worker(
    engine: Engine,
    dispatcher: ListDispatcher,
    resources: Any,
    host: LoopHost,
    policy: NodePolicy | None = None,
    fast: bool = True,
    max_calls: int = 0,
) -> NodeWorker:
    """A worker on ``engine``; ``fast``: the one-statement claim and store on autocommit connections (what a
    worker on PostgreSQL uses), else the portable multi-statement transactions."""
    return NodeWorker(
        sessions=make_session_factory(engine),
        dispatcher=dispatcher,
        resources_for=lambda aliases: resources,
        submit=host.submit,
        policy=policy or NodePolicy(lease_s=30.0, stale_s=5.0, retry_delay_s=0.0),
        direct=DirectPool(engine.url.render_as_string(hide_password=False)) if fast else None,
        max_calls=max_calls,
    )


def call_of(message: NodeMessage, redelivered: bool = False) -> NodeCall:
    token = node_task_id(message.job_id, message.item_id, message.node_id, message.attempt)
    return NodeCall(message.job_id, message.item_id, message.node_id, message.attempt, token, redelivered)


def drain(
    worker: NodeWorker, dispatcher: ListDispatcher, threads: int = 8, on_message: Callable[[NodeMessage], None] | None = None
) -> list[Outcome]:
    """Run every pending message (and those they send) until none is left; returns each delivery's outcome."""
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(threads) as pool:
        while True:
            batch = dispatcher.take()
            if not batch:
                return outcomes
            if on_message is not None:
                for m in batch:
                    on_message(m)
            outcomes.extend(pool.map(lambda m: run_node(worker, call_of(m)), batch))


def submit(sessions: sessionmaker[Session], pipeline: str, inputs: list[Any], **kwargs: Any) -> str:
    with session_scope(sessions) as session:
        job, _ = submit_job(session, JobRequest(pipeline, inputs=inputs, **kwargs))
        return job.id


def node_statuses(sessions: sessionmaker[Session], job_id: str) -> dict[str, int]:
    with session_scope(sessions) as session:
        stmt = select(NodeTask.status, func.count()).where(NodeTask.job_id == job_id).group_by(NodeTask.status)
        return {status: int(n) for status, n in session.execute(stmt)}


ENDPOINTS = Endpoints(None)
