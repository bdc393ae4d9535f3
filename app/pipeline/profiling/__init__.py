"""Run profiling: Chrome Trace Event output and run statistics.

``recording`` holds the profiler the scheduler calls (``TraceProfiler``); ``reporting`` turns what it recorded
(``records``) into a Chrome trace and ``ProfileStatistics``.
"""

from app.pipeline.profiling.recording import TraceProfiler
from app.pipeline.profiling.reporting import DurationStats, EndpointStatistics, ProfileStatistics

__all__ = ["DurationStats", "EndpointStatistics", "ProfileStatistics", "TraceProfiler"]
