"""One JSON log format for every inf-engine process (``serve``, ``worker``, ``beat``, ``flower``).

Each record is one line: ``{"ts", "level", "service", "logger", "msg", "request_id", "task_id", "job_id", ...}``
plus the record's own extra fields; an exception goes in ``exc``. ``request_id``, ``task_id`` and ``job_id`` are
always there (null when the line belongs to no request, task or job): the API binds the request id for the
duration of a request, a worker binds the task and job ids for the duration of a task (:func:`bind`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

CONTEXT_FIELDS = ("request_id", "task_id", "job_id")
_context: dict[str, ContextVar[str | None]] = {name: ContextVar(name, default=None) for name in CONTEXT_FIELDS}
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_service = "inf-engine"


def current_context() -> dict[str, str | None]:
    return {name: var.get() for name, var in _context.items()}


def bind(**fields: str | None) -> list[Token[str | None]]:
    """Set context fields (request_id, task_id, job_id) for this thread or task; :func:`unbind` undoes it."""
    unknown = set(fields) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"unknown log context fields: {', '.join(sorted(unknown))}")
    return [_context[name].set(value) for name, value in fields.items()]


def unbind(tokens: list[Token[str | None]]) -> None:
    for token in reversed(tokens):
        token.var.reset(token)


def clear() -> None:
    """Forget every context field (a worker thread between two tasks)."""
    for var in _context.values():
        var.set(None)


@contextmanager
def log_context(**fields: str | None) -> Iterator[None]:
    tokens = bind(**fields)
    try:
        yield
    finally:
        unbind(tokens)


class JsonFormatter(logging.Formatter):
    """The one format (module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": _service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(current_context())
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def level_name(level: str | int | None, default: str = "INFO") -> str:
    if isinstance(level, int) and level > 0:
        return logging.getLevelName(level)
    if isinstance(level, str) and level.strip():
        return level.strip().upper()
    return default


def configure_logging(level: str | int = "INFO", service: str | None = None) -> None:
    """Send every log record of this process to stderr as JSON lines, named ``service``."""
    global _service
    if service is not None:
        _service = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_name(level))
    # uvicorn's, Celery's and tornado's (Flower's) loggers keep no handlers of their own: everything goes through
    # the root's
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "tornado", "tornado.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
