"""The node store: every state change of one node of one item on the distributed path, behind one protocol.

A node task (``app.jobs.distributed.node_task``) claims its node, reads the item's stored values, stores its
result (which counts down its dependents' waiting dependencies), and, for an item's last node, stores the item's
outcome and the job's progress. Three implementations: :class:`~app.db.repository.node_store.core.CoreNodeStore`
(SQLAlchemy Core, PostgreSQL and SQLite, one transaction per operation),
:class:`~app.db.repository.node_store.psycopg.PsycopgNodeStore` (PostgreSQL, the hot operations as one
statement each on raw psycopg connections, group-committed) and
:class:`~app.db.repository.node_store.sqlite.SqliteNodeStore` (an SQLite file, the hot operations on one raw
sqlite3 connection whose writer thread group-commits them). Operations that can make a job terminal settle it
through the job layer's hook given to the store.

Values are the encoded JSON of the nodes' values (the job layer encodes and decodes them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from app.db.models import ItemStatus
from app.db.repository.node_tasks import NodeTaskRef


class ClaimStatus(StrEnum):
    """What a claim found."""

    CLAIMED = "claimed"  # the delivery runs the node now (running, one more attempt, leased)
    ALREADY_DONE = "already_done"  # its result is stored
    BUSY = "busy"  # another live delivery runs it
    CLOSED = "closed"  # its job or item is no longer open (or the node failed, or the job was deleted)
    NOT_READY = "not_ready"  # some dependency is not stored yet
    EXHAUSTED = "exhausted"  # started ``max_attempts`` times already: its item failed (TooManyAttempts)


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """One delivery's claim of a node. ``redelivered``: the broker gave this very task again, so it may take over
    its own earlier, still leased, claim; ``deadline``: the lease of a successful claim."""

    job_id: str
    item_id: int
    node_id: str
    token: str
    redelivered: bool
    max_attempts: int
    deadline: datetime
    now: datetime


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    """What a successful claim hands the node task: the job's pipeline, the item, its stored values."""

    pipeline_name: str
    pipeline_id: int
    item_input: dict[str, Any]
    custom_id: str
    values: dict[str, Any]  # {node_id: encoded value} of the item's stored nodes


@dataclass(frozen=True, slots=True)
class Claim:
    status: ClaimStatus
    attempts: int = 0  # deliveries that started the node, this one included (when claimed)
    item: ClaimedItem | None = None  # when claimed


@dataclass(frozen=True, slots=True)
class NodeValue:
    """One node's result, to store."""

    job_id: str
    item_id: int
    node_id: str
    value: Any  # encoded JSON
    duration_ms: float
    attempt: int
    now: datetime


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored result: ``inserted`` is False when another delivery had stored it (nothing changed then).
    ``values``: ``{node_id: encoded value}`` of the item's stored nodes, read in the same transaction, when a store
    reads them for the inline ops it made ready (None: not read; see ``NodeStore.item_values``)."""

    inserted: bool
    ready: list[NodeTaskRef]  # dependents whose last dependency it was: now queued, to send
    job_status: str | None  # the job's status (None: no such job)
    values: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ItemMetrics:
    """An item's LLM calls, tokens, cost and latency, added to its job's totals when it finishes."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    latency_ms_total: float = 0.0
    latency_ms_max: float = 0.0


@dataclass(frozen=True, slots=True)
class ItemEnd:
    """An item's terminal outcome, with the metrics its job's totals gain."""

    status: ItemStatus
    output: Any
    error: Any
    metrics: ItemMetrics = ItemMetrics()


@dataclass(frozen=True, slots=True)
class JobProgress:
    """The job's item counts after an item finished."""

    completed: int
    failed: int
    cancelled: int
    total: int

    @property
    def finished(self) -> bool:
        return self.completed + self.failed + self.cancelled >= self.total


@dataclass(frozen=True, slots=True)
class LastStored:
    """A result stored together with its item's outcome: ``progress`` is None when the item did not finish here
    (the result was stored before, the item was closed meanwhile, or some other node is unfinished)."""

    inserted: bool
    progress: JobProgress | None
    job_status: str | None


StoredValues = Callable[[], dict[str, Any]]
"""Reads ``{node_id: encoded value}`` of the item's stored nodes, in the operation's transaction."""

ItemEnder = Callable[[StoredValues], ItemEnd]
"""Decides an item's outcome once every node of it is stored (it may read the stored values it lacks)."""


def too_many_attempts(node_id: str, attempts: int) -> dict[str, Any]:
    """The error of an item whose node was started ``attempts`` times without finishing."""
    return {
        "type": "TooManyAttempts",
        "message": f"node {node_id} was started {attempts} times without finishing (its worker stopped each "
        "time); raise INF_ENGINE_NODE_MAX_ATTEMPTS to allow more",
    }



@dataclass(frozen=True, slots=True)
class Hold:
    """Dependents run by the delivery that stores their last dependency: those that become ready on ``queue``
    (None: no queue) and every ``op`` node (an ``F.*`` op, which that delivery runs on the spot). They are marked
    sent at once (no refill sends them too) and due by ``until`` (the sweeper sends them if it dies first)."""

    queue: str | None
    until: datetime


#: the kind of node_tasks row that a storing delivery runs itself (see :class:`Hold`)
INLINE_KIND = "op"


class NodeStore(Protocol):
    """The node state machine: waiting -> queued -> running -> done, or failed (see ``NodeTaskStatus``)."""

    def claim(self, request: ClaimRequest) -> Claim:
        """Claim the node for one delivery: a queued node of an open job and item below the attempts cap (or a
        running one whose lease ran out, or this very task's own re-delivery) becomes running, leased until
        ``request.deadline``, and a pending item running. A closed job or item fails the node (settling the job);
        the attempts cap fails the item."""
        ...

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """:meth:`claim` for each of ``requests`` (one delivery's nodes, sharing ``now``, ``deadline`` and
        ``max_attempts``), in their order; a store may claim the common case for all of them at once."""
        ...

    def renew(self, *, item_id: int, node_id: str, token: str, deadline: datetime) -> bool:
        """Push the running delivery's lease to ``deadline``; False when the node is no longer its."""
        ...

    def item_values(self, *, item_id: int) -> dict[str, Any]:
        """``{node_id: encoded value}`` of the item's stored nodes."""
        ...

    def store(
        self, value: NodeValue, *, dependents: Sequence[str], deadline: datetime, hold: Hold | None = None
    ) -> Stored:
        """Store the result (``ON CONFLICT DO NOTHING``), mark the node done and, if this call stored it and the
        job is open, count down one waiting dependency of each of ``dependents``: those whose last one it was
        become queued (due by ``deadline``; held ones: see :class:`Hold`) and are returned. One transaction."""
        ...

    def store_last(self, value: NodeValue, end: ItemEnd) -> LastStored:
        """For the node every other node of its item leads to: store its result and, if this call stored it and
        the item is open, the item's outcome ``end``, its place in the job's completion order, the job's counters
        and metrics; then settle the job when that may end it (its last item, a closed item, a cancel)."""
        ...

    def store_sink(self, value: NodeValue, end: ItemEnder) -> LastStored:
        """For a node without dependents: store its result and, if this call stored it and none of the item's
        nodes is left unfinished, the item's outcome (decided by ``end``), in one transaction; then settle the
        job when that may end it."""
        ...

    def finish_item(self, *, job_id: str, item_id: int, end: ItemEnder) -> JobProgress | None:
        """Store the outcome of an open item none of whose nodes is left unfinished (None otherwise), settling
        the job after its last item."""
        ...

    def requeue(self, *, item_id: int, node_id: str, token: str, deadline: datetime) -> NodeTaskRef | None:
        """Queue the node again, due by ``deadline`` (a transient failure of the running delivery ``token``);
        None when it finished or was taken over meanwhile."""
        ...

    def fail(self, *, job_id: str, item_id: int, node_id: str, error: dict[str, Any]) -> None:
        """The node failed: its item fails with ``error`` (its unfinished nodes will not run) and the job settles."""
        ...

    def settle(self, *, job_id: str) -> None:
        """Make the job terminal when it is due (its last item finished, or a cancel whose nodes stopped)."""
        ...
