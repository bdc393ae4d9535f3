from app.pipeline.context import get_active_tracer, trace_context
from app.pipeline.tracing.tracer import Tracer, trace

__all__ = ["Tracer", "get_active_tracer", "trace", "trace_context"]
