"""The server's logs: the shared JSON format (``app.logs``) and one access-log line per request."""

from __future__ import annotations

import logging
from typing import Any

from app.logs import JsonFormatter
from app.logs import configure_logging as _configure

ACCESS_LOGGER = "inf_engine.access"

__all__ = ["ACCESS_LOGGER", "JsonFormatter", "access_log", "configure_logging"]


def configure_logging(level: str = "INFO", service: str = "serve") -> None:
    """Send every log record to stderr as JSON (the server's own and uvicorn's)."""
    _configure(level, service)
    logging.getLogger("uvicorn.access").disabled = True  # our access log replaces it


def access_log(**fields: Any) -> None:
    logging.getLogger(ACCESS_LOGGER).info("request", extra=fields)
