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

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.serving.backends.base import EngineStats

__all__ = ["CONTENT_TYPE_LATEST", "ServingMetrics"]

LABELS = ["model_name", "engine"]
# vLLM's buckets, so dashboards' histogram_quantile panels read the same.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]  # fmt: skip
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
HTTP_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], labels: list[str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the engine is busy or gone
            stats = None
        if stats is None:
            return
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.num_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                stats.kv_cache_usage_perc,
            ),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self._labels, float(value))
            yield gauge
        counters: list[tuple[str, str, int]] = [
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemptions from the engine.",
                stats.num_preemptions,
            ),
        ]
        if stats.spec_decode_enabled:  # as vLLM: only with speculative decoding on
            counters += [
                (
                    "vllm:spec_decode_num_drafts",
                    "Number of spec decoding drafts.",
                    stats.spec_decode_num_drafts,
                ),
                (
                    "vllm:spec_decode_num_draft_tokens",
                    "Number of draft tokens.",
                    stats.spec_decode_num_draft_tokens,
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens",
                    "Accepted tokens.",
                    stats.spec_decode_num_accepted_tokens,
                ),
            ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._labels, float(value))
            yield counter
        if stats.eviction_policy is not None:
            yield from self._prefix_cache_by_policy(stats, stats.eviction_policy)
        if stats.spec_decode_enabled:
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*LABELS, "position"],
            )
            for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*self._labels, str(position)], float(value))
            yield per_pos

    def _prefix_cache_by_policy(self, stats: EngineStats, policy: str) -> Iterator[Metric]:
        labels = [*self._labels, policy]
        tokens = (
            ("queries", "Prefix cache queries, in tokens, by eviction policy.", stats.prefix_cache_queries),
            ("hits", "Prefix cache hits, in tokens, by eviction policy.", stats.prefix_cache_hits),
            (
                "misses",
                "Prefix cache misses (queried tokens not served from the cache), by eviction policy.",
                stats.prefix_cache_queries - stats.prefix_cache_hits,
            ),
        )
        for what, doc, value in tokens:
            counter = CounterMetricFamily(f"inf_engine_prefix_cache_{what}", doc, labels=[*LABELS, "policy"])
            counter.add_metric(labels, float(value))
            yield counter
        evictions = CounterMetricFamily(
            "inf_engine_prefix_cache_evictions",
            "Cached KV blocks given up, by eviction policy and reason (capacity: for a fresh block; "
            "ttl: unused for the time-to-live).",
            labels=[*LABELS, "policy", "reason"],
        )
        evictions.add_metric([*labels, "capacity"], float(stats.prefix_cache_evictions))
        evictions.add_metric([*labels, "ttl"], float(stats.prefix_cache_expirations))
        yield evictions


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
            reg.register(_EngineStatsCollector(stats, self.labels))
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
