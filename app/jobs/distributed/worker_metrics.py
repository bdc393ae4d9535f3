"""A worker's own ``/metrics``, served by the worker process itself (setting ``worker_metrics_port``).

The API's ``/metrics`` exports what the cluster shares (``inf_engine_jobs``, queue depths, every worker's node
latencies through Redis); this endpoint exports what only this process knows:

* the ``vllm:*`` series of the engines an ``--engine`` worker hosts (the node tasks call them in process, so no
  server watches their streams: the per-request series come from the engine's own statistics), with vLLM's
  names, labels (``model_name``, ``engine``) and buckets, and our ``inf_engine_prefix_cache_*``;
* ``inf_engine_worker_tasks_total{task,state}``, ``inf_engine_worker_tasks_running{task}``,
  ``inf_engine_worker_node_seconds{kind}`` (histogram), ``inf_engine_worker_task_slots`` and
  ``inf_engine_worker_info{role,pool,queues}``;
* the process's own ``process_*`` and ``python_*`` series.

Task series are counted where tasks run: with the thread pool (engine workers, and the manifests' plain workers)
that is this process; prefork children would count in their own memory, which this endpoint does not see.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    start_http_server,
)

from app.jobs.distributed.monitoring import NODE_BUCKETS
from app.serving.metrics import EngineSnapshot, InProcessEngineCollector

__all__ = ["MetricsServer", "WorkerMetrics", "embedded_engine_snapshots", "worker_metrics"]


class WorkerMetrics:
    """The registry of one worker process; every method is cheap and thread-safe (task threads call them)."""

    def __init__(self) -> None:
        disable_created_metrics()  # as vLLM and the API: no *_created series
        self.registry = CollectorRegistry()
        reg = self.registry
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            reg.register(collector)
        self.tasks = Counter(
            "inf_engine_worker_tasks", "Tasks this worker finished, by task name and Celery state.",
            ["task", "state"], registry=reg,
        )  # fmt: skip
        self.running = Gauge("inf_engine_worker_tasks_running", "Tasks this worker runs now.", ["task"], registry=reg)
        self.nodes = Histogram(
            "inf_engine_worker_node_seconds", "Seconds one node task took on this worker, by node kind.", ["kind"],
            buckets=NODE_BUCKETS, registry=reg,
        )  # fmt: skip
        self.slots = Gauge("inf_engine_worker_task_slots", "Tasks this worker may run at once.", registry=reg)
        self.info = Info("inf_engine_worker", "This worker's role, pool and queues.", registry=reg)
        self._engines = False

    def describe(self, *, role: str, pool: str, queues: Sequence[str], slots: int) -> None:
        self.info.info({"role": role, "pool": pool, "queues": ",".join(queues)})
        self.slots.set(slots)

    def host_engines(self) -> None:
        """Export the ``vllm:*`` series of this process's in-process engines (an ``--engine`` worker)."""
        if not self._engines:
            self._engines = True
            self.registry.register(InProcessEngineCollector(embedded_engine_snapshots))

    def task_started(self, task: str) -> None:
        self.running.labels(task).inc()

    def task_finished(self, task: str, state: str) -> None:
        self.running.labels(task).dec()
        self.tasks.labels(task, state).inc()

    def node_finished(self, kind: str, seconds: float) -> None:
        self.nodes.labels(kind).observe(seconds)


def embedded_engine_snapshots() -> list[EngineSnapshot]:
    """The engines of ``app.serving.embedded`` that served a request (the weights load on first use)."""
    from app.serving.embedded import embedded_engines

    snapshots = []
    for index, hosted in enumerate(embedded_engines()):
        backend = hosted.started_backend
        if backend is not None and backend.engine is not None:
            snapshots.append(EngineSnapshot.of_engine(backend.served_model_name, backend.engine.get_stats(),
                                                      str(index)))
    return snapshots


_lock = threading.Lock()
_process: WorkerMetrics | None = None


def worker_metrics() -> WorkerMetrics:
    """This process's worker metrics (built on first use)."""
    global _process
    with _lock:
        if _process is None:
            _process = WorkerMetrics()
        return _process


class MetricsServer:
    """``GET /metrics`` of ``registry`` on ``host:port`` (0: a free port), from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
