"""The active tracer, kept in a context variable so concurrent traces in one process never mix."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.pipeline.tracing.tracer import Tracer

_ACTIVE: ContextVar[Tracer | None] = ContextVar("inf_engine_active_tracer", default=None)


def get_active_tracer() -> Tracer | None:
    return _ACTIVE.get()


@contextmanager
def trace_context(tracer: Tracer) -> Iterator[Tracer]:
    token = _ACTIVE.set(tracer)
    try:
        yield tracer
    finally:
        _ACTIVE.reset(token)
