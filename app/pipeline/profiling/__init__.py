"""Run profiling: Chrome Trace Event output and run statistics."""

from app.pipeline.profiling.profiler import (
    DurationStats,
    EndpointStatistics,
    ProfileStatistics,
    TraceProfiler,
)

__all__ = ["DurationStats", "EndpointStatistics", "ProfileStatistics", "TraceProfiler"]
