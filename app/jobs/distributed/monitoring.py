"""Platform metrics shared by every process: workers record into Redis, the API reads them (and the jobs table)
at scrape time and exports them on ``/metrics`` as ``inf_engine_*``.

Workers are many processes on many machines, so their node latencies and rate-limit waits cannot live in one
process's Prometheus registry: each observation is a few ``HINCRBY`` on shared hashes (one round trip).

These series describe the whole cluster, not the replica that answers the scrape, so only one API replica exports
them: the holder of a Redis lock (:class:`ExportLeader`). Every replica exports ``inf_engine_metrics_leader``
(1 on the one that leads, 0 on the others), so the series appear once and ``sum by (...)`` -- the query people
write -- counts each job once, however many replicas run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
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


_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class ExportLeader:
    """Which process exports the cluster-wide series: the holder of the lock ``key`` in Redis (TTL ``ttl_s``).

    :meth:`holds` is asked at scrape time: the holder answers from memory, another process tries to take the lock
    (one round trip). The holder renews it every third of the TTL from a daemon thread, so it keeps leading
    whatever the scrape interval; a holder that stops (:meth:`release`, at shutdown) frees it at once, one that
    dies frees it after the TTL. While Redis is away the holder keeps leading until its TTL would have run out,
    and nobody else can take over.
    """

    def __init__(self, redis: Callable[[], Redis | None], key: str, ttl_s: float = 30.0) -> None:
        self._redis = redis
        self.key = key
        self.ttl_s = ttl_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._held_until = 0.0  # time.monotonic() before which the lock is surely ours
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def holds(self) -> bool:
        if time.monotonic() < self._held_until:
            return True
        with self._lock:
            if self._take_or_renew():
                if self._renewer is None or not self._renewer.is_alive() or self._stop.is_set():
                    self._stop = threading.Event()
                    self._renewer = threading.Thread(target=self._renew, args=(self._stop,),
                                                     name="metrics-leader", daemon=True)
                    self._renewer.start()
                return True
            return False

    def _take_or_renew(self) -> bool:
        """One round trip; False when another process holds the lock or Redis is away (then we hold what we
        held: ``_held_until`` runs out by itself)."""
        redis = self._redis()
        if redis is None:
            return False
        started = time.monotonic()
        try:
            taken = bool(redis.eval(_HOLD, 1, self.key, self.token, int(self.ttl_s * 1000)))
        except Exception as exc:
            log.warning("cannot reach Redis for the metrics lock %s: %s", self.key, exc)
            return time.monotonic() < self._held_until
        self._held_until = started + self.ttl_s if taken else 0.0
        return taken

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):
            with self._lock:
                if not self._take_or_renew() and time.monotonic() >= self._held_until:
                    return  # another replica leads now; a later scrape may take the lock again

    def release(self) -> None:
        """Stop leading (at shutdown): another replica takes over at its next scrape."""
        self._stop.set()
        with self._lock:
            held, self._held_until = self._held_until > 0, 0.0
            redis = self._redis() if held else None
            if redis is not None:
                try:
                    redis.eval(_RELEASE, 1, self.key, self.token)
                except Exception as exc:  # Redis away: the lock lapses with its TTL
                    log.warning("cannot release the metrics lock %s: %s", self.key, exc)


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
    shown in the per-tenant gauges even with nothing open (others only while they have open jobs). With a
    ``leader``, the series are exported only while this process leads (several API replicas); without one (no
    Redis: one process), always."""

    def __init__(
        self,
        job_counts: Callable[[], JobCounts | None],
        redis: Callable[[], Redis | None],
        prefix: str,
        queues: Mapping[str, Sequence[str]],
        job_statuses: Sequence[str] = (),
        tenants: Sequence[str] = (),
        leader: ExportLeader | None = None,
    ) -> None:
        self._job_counts = job_counts
        self._leader = leader
        self._redis = redis
        self._prefix = prefix
        self._queues = queues
        self._job_statuses = job_statuses
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        leading = True
        if self._leader is not None:
            try:
                leading = self._leader.holds()
            except Exception:  # a scrape must not fail because Redis is away
                leading = False
        yield GaugeMetricFamily(
            "inf_engine_metrics_leader",
            "1 on the API replica that exports the cluster-wide inf_engine_* series (a Redis lock), 0 on the others",
            value=1.0 if leading else 0.0,
        )
        if not leading:
            return
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

    def close(self) -> None:
        """Hand the cluster-wide series over to another replica (at shutdown)."""
        if self._leader is not None:
            self._leader.release()

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

