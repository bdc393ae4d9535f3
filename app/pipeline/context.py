"""The active tracer, kept in a context variable so concurrent traces in one process never mix.

A leaf module: values, ops and modules ask it whether a trace is running without importing the tracer (which
builds on all of them). ``ActiveTracer`` is the part of ``Tracer`` they call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar


class ActiveTracer(Protocol):
    """What values, ``F`` ops and modules call on the running trace (``app.pipeline.tracing.Tracer``)."""

    def owns_ref(self, ref: str) -> bool: ...

    def placeholder_for(self, value: Any) -> str: ...

    def is_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool: ...

    def record_op(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def record_call(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def trace_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


_T = TypeVar("_T", bound=ActiveTracer)

_ACTIVE: ContextVar[ActiveTracer | None] = ContextVar("inf_engine_active_tracer", default=None)


def get_active_tracer() -> ActiveTracer | None:
    return _ACTIVE.get()


@contextmanager
def trace_context(tracer: _T) -> Iterator[_T]:
    token = _ACTIVE.set(tracer)
    try:
        yield tracer
    finally:
        _ACTIVE.reset(token)
