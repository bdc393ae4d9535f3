"""Platform metrics shared by every process: workers record into Redis, the API reads them (and the jobs table)
at scrape time and exports them on ``/metrics`` as ``inf_engine_*``.

Workers are many processes on many machines, so their node latencies and rate-limit waits cannot live in one
process's Prometheus registry: each observation is a few ``HINCRBY`` on shared hashes (one round trip).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis

log = logging.getLogger(__name__)

NODE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


def _key(prefix: str, *parts: str) -> str:
    return ":".join((prefix, "metrics", *parts))


def _bucket(seconds: float) -> str:
    for bound in NODE_BUCKETS:
        if seconds <= bound:
            return repr(bound)
    return "+Inf"


class BufferedRecorder:
    """Adds observations up in memory and writes them every ``interval_s`` from a daemon thread: one round trip a
    second instead of one per node (a worker runs hundreds of nodes a second). A killed worker loses at most the
    last interval's observations."""

    def __init__(self, redis: Redis, prefix: str, interval_s: float = 1.0) -> None:
        self.redis = redis
        self.prefix = prefix
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, float]] = {}
        self._waits: dict[str, list[float]] = {}
        self._thread: threading.Thread | None = None

    def node_finished(self, kind: str, seconds: float) -> None:
        with self._lock:
            hist = self._nodes.setdefault(kind, {})
            bucket = _bucket(seconds)
            hist[bucket] = hist.get(bucket, 0) + 1
            hist["sum"] = hist.get("sum", 0.0) + seconds
            hist["count"] = hist.get("count", 0) + 1
            self._ensure_thread()

    def rate_limit_wait(self, endpoint: str, seconds: float) -> None:
        with self._lock:
            entry = self._waits.setdefault(endpoint, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="metrics-flush", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self.flush()
            except Exception as exc:  # Redis away: these observations are lost, the next ones are kept
                log.warning("could not write platform metrics: %s", exc)

    def flush(self) -> None:
        with self._lock:
            nodes, self._nodes = self._nodes, {}
            waits, self._waits = self._waits, {}
        if not nodes and not waits:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for kind, hist in nodes.items():
                key = _key(self.prefix, "node_seconds", kind)
                for field, value in hist.items():
                    if field == "sum":
                        pipe.hincrbyfloat(key, field, value)
                    else:
                        pipe.hincrby(key, field, int(value))
                pipe.sadd(_key(self.prefix, "node_kinds"), kind)
            for endpoint, (count, seconds) in waits.items():
                key = _key(self.prefix, "rate_waits")
                pipe.hincrby(key, f"count:{endpoint}", int(count))
                pipe.hincrbyfloat(key, f"seconds:{endpoint}", seconds)
            pipe.execute()


@dataclass(frozen=True)
class JobCounts:
    """From the jobs table: jobs per status, the items of all jobs that finished, per outcome, and each tenant's
    open items (``{tenant: {"pending": n, "running": m}}``)."""

    jobs: Mapping[str, int]
    items_done: Mapping[str, int]
    tenant_items: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)


class PlatformCollector(Collector):
    """Reads everything at scrape time. ``job_counts`` returns None while the jobs database is not open;
    ``redis`` returns None without Redis; ``queues`` maps each queue name to its Redis lists; ``tenants`` are
    shown in the per-tenant gauges even with nothing open (others only while they have open jobs)."""

    def __init__(
        self,
        job_counts: Callable[[], JobCounts | None],
        redis: Callable[[], Redis | None],
        prefix: str,
        queues: Mapping[str, Sequence[str]],
        job_statuses: Sequence[str] = (),
        tenants: Sequence[str] = (),
    ) -> None:
        self._job_counts = job_counts
        self._redis = redis
        self._prefix = prefix
        self._queues = queues
        self._job_statuses = job_statuses
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        try:
            redis = self._redis()
        except Exception:
            redis = None
        if redis is not None:
            try:
                yield from self._from_redis(redis)
            except Exception:  # a scrape must not fail because Redis is away
                return

    def _jobs(self) -> Iterator[Metric]:
        try:
            counts = self._job_counts()
        except Exception:  # the database is away: no job series in this scrape
            counts = None
        if counts is None:
            return
        jobs = GaugeMetricFamily("inf_engine_jobs", "Jobs by status.", labels=["status"])
        for status in sorted({*self._job_statuses, *counts.jobs}):
            jobs.add_metric([status], float(counts.jobs.get(status, 0)))
        yield jobs
        done = CounterMetricFamily("inf_engine_items_done", "Items that finished, by outcome.", labels=["status"])
        for status in ("completed", "failed", "cancelled"):
            done.add_metric([status], float(counts.items_done.get(status, 0)))
        yield done
        yield from self._tenant_gauges(counts.tenant_items)

    def _tenant_gauges(self, tenant_items: Mapping[str, Mapping[str, int]]) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "inf_engine_tenant_queued_items", "Items pending in each tenant's open jobs.", labels=["tenant"]
        )
        running = GaugeMetricFamily(
            "inf_engine_tenant_running_items", "Items running in each tenant's open jobs.", labels=["tenant"]
        )
        for tenant in sorted({*self._tenants, *tenant_items}):
            counts = tenant_items.get(tenant, {})
            queued.add_metric([tenant], float(counts.get("pending", 0)))
            running.add_metric([tenant], float(counts.get("running", 0)))
        yield queued
        yield running

    def _from_redis(self, redis: Redis) -> Iterator[Metric]:
        depth = GaugeMetricFamily("inf_engine_queue_depth", "Node tasks waiting in each queue.", labels=["queue"])
        with redis.pipeline(transaction=False) as pipe:
            for keys in self._queues.values():
                for key in keys:
                    pipe.llen(key)
            lengths = iter(pipe.execute())
        for queue, keys in self._queues.items():
            depth.add_metric([queue], float(sum(int(next(lengths)) for _ in keys)))
        yield depth

        latency = HistogramMetricFamily(
            "inf_engine_node_latency_seconds", "Seconds one node task took to run, by node kind.", labels=["kind"]
        )
        kinds = sorted(k.decode() if isinstance(k, bytes) else str(k)
                       for k in redis.smembers(_key(self._prefix, "node_kinds")))  # type: ignore[union-attr]
        for kind in kinds:
            raw = _decode(redis.hgetall(_key(self._prefix, "node_seconds", kind)))
            cumulative, buckets = 0.0, []
            for bound in [*(repr(b) for b in NODE_BUCKETS), "+Inf"]:
                cumulative += float(raw.get(bound, 0))
                buckets.append((bound, cumulative))
            latency.add_metric([kind], buckets, sum_value=float(raw.get("sum", 0.0)))
        yield latency

        waits = CounterMetricFamily(
            "inf_engine_rate_limit_waits", "Requests that waited for an endpoint's global limit.", labels=["endpoint"]
        )
        seconds = CounterMetricFamily(
            "inf_engine_rate_limit_wait_seconds", "Seconds requests waited for an endpoint's global limit.",
            labels=["endpoint"],
        )
        raw_waits = _decode(redis.hgetall(_key(self._prefix, "rate_waits")))
        for field, value in sorted(raw_waits.items()):
            kind, _, endpoint = field.partition(":")
            (waits if kind == "count" else seconds).add_metric([endpoint], float(value))
        yield waits
        yield seconds


def _decode(raw: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in dict(raw or {}).items():
        key = k.decode() if isinstance(k, bytes) else str(k)
        out[key] = v.decode() if isinstance(v, bytes) else str(v)
    return out

