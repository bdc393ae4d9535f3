"""Prometheus metrics under vLLM's names and labels (``model_name``, ``engine``), plus HTTP metrics.

Per-request metrics (tokens, TTFT, inter-token latency, end-to-end latency, queue time, successes) are
observed by the server as it streams, so every backend gets them; scheduler and cache gauges come from
``Backend.stats()`` at scrape time. Each app has its own registry (several apps may live in one process).

Our engine also reports its prefix cache per eviction policy, under our own names (vLLM has no such series):
``inf_engine_prefix_cache_{queries,hits,misses}_total`` in tokens, and
``inf_engine_prefix_cache_evictions_total`` in blocks with ``reason`` ``capacity`` (given up for a fresh
block) or ``ttl`` (unused for the time-to-live), all labelled with the ``policy``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from app.serving.backends.base import EngineStats

__all__ = ["CONTENT_TYPE_LATEST", "EngineSnapshot", "InProcessEngineCollector", "ServingMetrics"]

LABELS = ["model_name", "engine"]
# vLLM's buckets, so dashboards' histogram_quantile panels read the same.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]  # fmt: skip
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
HTTP_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


#: one engine's labels (model_name, engine) and its scrape-time gauges
LabelledStats = tuple[list[str], EngineStats]


class _EngineStatsCollector(Collector):
    """The scheduler and cache series of one or more engines (one family per name, a sample per engine)."""

    def __init__(self, stats: Callable[[], Iterable[LabelledStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            engines = list(self._stats())
        except Exception:  # a scrape must not fail because the engine is busy or gone
            engines = []
        if not engines:
            return
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage_perc"),
        )
        for name, doc, field in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            for labels, stats in engines:
                gauge.add_metric(labels, float(getattr(stats, field)))
            yield gauge
        counters = [
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits"),
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
        ]
        for name, doc, field in counters:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, stats in engines:
                counter.add_metric(labels, float(getattr(stats, field)))
            yield counter
        by_policy = [(labels, stats) for labels, stats in engines if stats.eviction_policy is not None]
        if by_policy:
            yield from self._prefix_cache_by_policy(by_policy)
        speculating = [(labels, stats) for labels, stats in engines if stats.spec_decode_enabled]
        if speculating:  # as vLLM: only with speculative decoding on
            yield from self._spec_decode(speculating)

    @staticmethod
    def _spec_decode(engines: list[LabelledStats]) -> Iterator[Metric]:
        counters = [
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Accepted tokens.", "spec_decode_num_accepted_tokens"),
        ]
        for name, doc, field in counters:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, stats in engines:
                counter.add_metric(labels, float(getattr(stats, field)))
            yield counter
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for labels, stats in engines:
            for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(position)], float(value))
        yield per_pos

    @staticmethod
    def _prefix_cache_by_policy(engines: list[LabelledStats]) -> Iterator[Metric]:
        docs = (
            ("queries", "Prefix cache queries, in tokens, by eviction policy."),
            ("hits", "Prefix cache hits, in tokens, by eviction policy."),
            ("misses", "Prefix cache misses (queried tokens not served from the cache), by eviction policy."),
        )
        for what, doc in docs:
            counter = CounterMetricFamily(f"inf_engine_prefix_cache_{what}", doc, labels=[*LABELS, "policy"])
            for labels, stats in engines:
                value = {"queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits,
                         "misses": stats.prefix_cache_queries - stats.prefix_cache_hits}[what]
                counter.add_metric([*labels, str(stats.eviction_policy)], float(value))
            yield counter
        evictions = CounterMetricFamily(
            "inf_engine_prefix_cache_evictions",
            "Cached KV blocks given up, by eviction policy and reason (capacity: for a fresh block; "
            "ttl: unused for the time-to-live).",
            labels=[*LABELS, "policy", "reason"],
        )
        for labels, stats in engines:
            policy = str(stats.eviction_policy)
            evictions.add_metric([*labels, policy, "capacity"], float(stats.prefix_cache_evictions))
            evictions.add_metric([*labels, policy, "ttl"], float(stats.prefix_cache_expirations))
        yield evictions


@dataclass(frozen=True)
class EngineSnapshot:
    """One in-process engine at scrape time: its labels, its scheduler and cache gauges (what ``Backend.stats()``
    returns) and its own request statistics (``app.engine.metrics.EngineStats``: tokens, finished requests and
    the latency histograms, kept by the engine as it steps)."""

    model_name: str
    gauges: EngineStats
    requests: Any
    engine: str = "0"

    @classmethod
    def of_engine(cls, model_name: str, stats: Any, engine: str = "0") -> EngineSnapshot:
        """From one ``app.engine.metrics.EngineStats`` (``LLMEngine.get_stats()``), gauges and all."""
        return cls(model_name, EngineStats(
            num_running=stats.num_requests_running,
            num_waiting=stats.num_requests_waiting,
            kv_cache_usage_perc=stats.kv_cache_usage_perc,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            eviction_policy=stats.eviction_policy,
            prefix_cache_evictions=stats.prefix_cache_evictions,
            prefix_cache_expirations=stats.prefix_cache_expirations,
            spec_decode_enabled=stats.spec_decode_enabled,
            spec_decode_num_drafts=stats.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(stats.spec_decode_num_accepted_tokens_per_pos),
        ), stats, engine)  # fmt: skip


class InProcessEngineCollector(Collector):
    """Every ``vllm:*`` series of the engines a process hosts without serving them over HTTP (an engine worker,
    whose node tasks call the engine directly): the per-request series come from the engine's own statistics
    rather than from a server watching its streams, under the same names, labels and buckets."""

    def __init__(self, snapshots: Callable[[], Iterable[EngineSnapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        try:
            taken = list(self._snapshots())
        except Exception:  # a scrape must not fail because an engine is loading or gone
            taken = []
        if not taken:
            return
        yield from _EngineStatsCollector(lambda: [([s.model_name, s.engine], s.gauges) for s in taken]).collect()
        engines = [([s.model_name, s.engine], s.requests) for s in taken]
        for name, doc, field in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
        ):
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, stats in engines:
                counter.add_metric(labels, float(getattr(stats, field)))
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*LABELS, "finished_reason"]
        )
        for labels, stats in engines:
            for reason, count in sorted(stats.request_success.items()):
                success.add_metric([*labels, reason], float(count))
        yield success
        for name, doc, field in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             "time_to_first_token_seconds"),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             "inter_token_latency_seconds"),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             "e2e_request_latency_seconds"),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             "request_queue_time_seconds"),
        ):  # fmt: skip
            histogram = HistogramMetricFamily(name, doc, labels=LABELS)
            for labels, stats in engines:
                hist = getattr(stats, field)
                bounds = [*(repr(float(b)) for b in hist.buckets), "+Inf"]
                histogram.add_metric(labels, list(zip(bounds, map(float, hist.cumulative()), strict=True)),
                                     sum_value=float(hist.total))
            yield histogram


class ServingMetrics:
    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats | None] | None = None, engine: str = "0"
    ) -> None:
        disable_created_metrics()  # as vLLM does: no *_created series (process-wide switch)
        self.registry = CollectorRegistry()
        self.labels = [model_name, engine]
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=reg
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.http_requests = Counter(
            "http_requests", "HTTP requests by handler, method and status.", ["handler", "method", "status"],
            registry=reg,
        )  # fmt: skip
        self.http_latency = Histogram(
            "http_request_duration_seconds",
            "HTTP request latency (to the last byte of the response) by handler and method.",
            ["handler", "method"],
            buckets=HTTP_BUCKETS,
            registry=reg,
        )
        if stats is not None:
            reg.register(_EngineStatsCollector(lambda: [(self.labels, s)] if (s := stats()) is not None else []))
        # Children bound once: labels() is a dict lookup under a lock, cheap but not free per token.
        self._prompt = self.prompt_tokens.labels(*self.labels)
        self._generation = self.generation_tokens.labels(*self.labels)
        self._ttft = self.ttft.labels(*self.labels)
        self._itl = self.itl.labels(*self.labels)
        self._e2e = self.e2e.labels(*self.labels)
        self._queue = self.queue_time.labels(*self.labels)

    # -- per request
    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def observe_finished(
        self, *, e2e: float, prompt_tokens: int, generation_tokens: int, reason: str
    ) -> None:
        self._e2e.observe(e2e)
        self._prompt.inc(prompt_tokens)
        self._generation.inc(generation_tokens)
        self.request_success.labels(*self.labels, reason).inc()

    # -- HTTP
    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()
        self.http_latency.labels(handler, method).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
