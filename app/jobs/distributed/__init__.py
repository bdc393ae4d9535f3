"""Node tasks: each graph node of each item is one task on a transport: Celery (``transport/celery_*``, consumed
by ``workers/``) or the server's in-process queue (``transport/inprocess``, the embedded mode).

PostgreSQL holds the truth (``node_tasks``: waiting counts, attempts, leases; ``node_results``: the values);
the transport only carries ids. See ``dispatch`` (submission → first tasks), ``node_task`` (one node, the
function behind the Celery task; every change of a node's state goes through the node store,
``app.db.repository.node_store``), ``sweeper`` (lost workers and messages, expiry) and ``limited`` (endpoints
behind the global limits).
"""

from app.jobs.distributed.dispatch import dispatch_job
from app.jobs.distributed.messages import Dispatcher, Endpoints, NodeMessage
from app.jobs.distributed.node_task import NodeCall, NodePolicy, NodeWorker, Outcome, run_node
from app.jobs.distributed.sweeper import SweepReport, sweep

__all__ = [
    "Dispatcher",
    "Endpoints",
    "NodeCall",
    "NodeMessage",
    "NodePolicy",
    "NodeWorker",
    "Outcome",
    "SweepReport",
    "dispatch_job",
    "run_node",
    "sweep",
]
