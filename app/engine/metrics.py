"""Request metrics and engine statistics, named after vLLM's Prometheus metrics so dashboards carry over.

Times are ``time.monotonic()`` seconds (the clock ``Sequence.arrival_time`` uses): only differences matter.
:class:`StatsCollector` is written by the engine thread and read by whoever serves ``/metrics``, so it
takes a lock; :meth:`StatsCollector.snapshot` returns plain copies that are safe to use anywhere.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.spec_decode import SpecDecodeStats

__all__ = [
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "TTFT_BUCKETS",
    "EngineStats",
    "Histogram",
    "RequestMetrics",
    "StatsCollector",
]

# vLLM's bucket boundaries, so histograms from both engines can be compared panel by panel.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class RequestMetrics:
    """Timeline of one request. ``None`` fields have not happened yet."""

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduling (the last one counts nothing extra after a preemption)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def mean_inter_token_latency(self) -> float | None:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None

    def on_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def on_tokens(self, now: float, count: int) -> float | None:
        """Record ``count`` new tokens produced at ``now``; returns the inter-token latency, if any."""
        itl: float | None = None
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            itl = now - self.last_token_time
            self.inter_token_latencies.append(itl)
        self.last_token_time = now
        self.num_generation_tokens += count
        return itl

    def copy(self) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=self.arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=self.finished_time,
            num_generation_tokens=self.num_generation_tokens,
            num_cached_tokens=self.num_cached_tokens,
            inter_token_latencies=list(self.inter_token_latencies),
        )


@dataclass
class Histogram:
    """A cumulative-bucket histogram in Prometheus' sense (``counts[i]`` = observations <= ``buckets[i]``,
    computed on export; stored per bucket here)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # one per bucket, plus the +Inf bucket
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError("histogram buckets must be increasing")
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[int]:
        out, running = [], 0
        for c in self.counts:
            running += c
            out.append(running)
        return out

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


@dataclass
class EngineStats:
    """A point-in-time copy of the engine's gauges, counters and latency histograms."""

    # gauges
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    # counters (monotonic over the engine's life)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # the prefix cache's eviction policy, and the cached blocks it gave up for fresh ones or to its TTL
    eviction_policy: str = "lru"
    prefix_cache_evictions: int = 0
    prefix_cache_expirations: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=dict)  # finish reason -> finished sequences
    num_steps: int = 0
    # histograms (seconds)
    time_to_first_token_seconds: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency_seconds: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency_seconds: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    request_queue_time_seconds: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # speculative decoding (counters; all zero and the per-position list empty when it is off)
    spec_decode_enabled: bool = False
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft (accepted proposals + the model's own token); 0 before any."""
        n = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / n if n else 0.0


class StatsCollector:
    """Accumulates counters and histograms; the scheduler-owned numbers are passed in at snapshot time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = EngineStats()

    def record_first_token(self, metrics: RequestMetrics) -> None:
        with self._lock:
            self._stats.prompt_tokens += metrics.num_prompt_tokens
            if metrics.time_to_first_token is not None:
                self._stats.time_to_first_token_seconds.observe(metrics.time_to_first_token)
            if metrics.queue_time is not None:
                self._stats.request_queue_time_seconds.observe(metrics.queue_time)

    def record_step(self, num_tokens: int, inter_token_latencies: Iterable[float] = ()) -> None:
        """One step: its generated tokens and its requests' inter-token latencies (one lock per step)."""
        with self._lock:
            self._stats.num_steps += 1
            self._stats.generation_tokens += num_tokens
            hist = self._stats.inter_token_latency_seconds
            for itl in inter_token_latencies:
                hist.observe(itl)

    def record_finished(self, metrics: RequestMetrics, finish_reasons: Iterable[str]) -> None:
        with self._lock:
            for reason in finish_reasons:
                self._stats.request_success[reason] = self._stats.request_success.get(reason, 0) + 1
            if metrics.e2e_latency is not None:
                self._stats.e2e_request_latency_seconds.observe(metrics.e2e_latency)

    def snapshot(
        self,
        *,
        num_requests_running: int,
        num_requests_waiting: int,
        kv_cache_usage_perc: float,
        prefix_cache_queries: int,
        prefix_cache_hits: int,
        num_preemptions: int,
        spec_decode: SpecDecodeStats | None = None,
        eviction_policy: str = "lru",
        prefix_cache_evictions: int = 0,
        prefix_cache_expirations: int = 0,
    ) -> EngineStats:
        with self._lock:
            s = self._stats
            spec: dict[str, object] = {}
            if spec_decode is not None:
                spec = dict(
                    spec_decode_enabled=True,
                    spec_decode_num_drafts=spec_decode.num_drafts,
                    spec_decode_num_draft_tokens=spec_decode.num_draft_tokens,
                    spec_decode_num_accepted_tokens=spec_decode.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(spec_decode.num_accepted_tokens_per_pos),
                )
            return EngineStats(
                num_requests_running=num_requests_running,
                num_requests_waiting=num_requests_waiting,
                kv_cache_usage_perc=kv_cache_usage_perc,
                prefix_cache_queries=prefix_cache_queries,
                prefix_cache_hits=prefix_cache_hits,
                num_preemptions=num_preemptions,
                eviction_policy=eviction_policy,
                prefix_cache_evictions=prefix_cache_evictions,
                prefix_cache_expirations=prefix_cache_expirations,
                prompt_tokens=s.prompt_tokens,
                generation_tokens=s.generation_tokens,
                request_success=dict(s.request_success),
                num_steps=s.num_steps,
                time_to_first_token_seconds=s.time_to_first_token_seconds.copy(),
                inter_token_latency_seconds=s.inter_token_latency_seconds.copy(),
                e2e_request_latency_seconds=s.e2e_request_latency_seconds.copy(),
                request_queue_time_seconds=s.request_queue_time_seconds.copy(),
                **spec,  # type: ignore[arg-type]
            )
