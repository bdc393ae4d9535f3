"""Errors raised by LLM clients, classified the way the scheduler treats them."""

from __future__ import annotations


class ResourceError(Exception):
    """A request to an endpoint failed in a way that retrying will not fix (bad request, auth, ...)."""

    def __init__(self, message: str, *, status: int | None = None, alias: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.alias = alias


class RateLimitError(ResourceError):
    """The endpoint answered 429; ``retry_after`` is the server's Retry-After in seconds, when it sent one."""

    def __init__(
        self,
        message: str = "rate limited",
        *,
        retry_after: float | None = None,
        status: int | None = 429,
        alias: str | None = None,
    ) -> None:
        super().__init__(message, status=status, alias=alias)
        self.retry_after = retry_after


class TransientError(ResourceError):
    """A failure worth retrying: timeouts, 5xx answers, dropped or refused connections."""


class ConfigurationError(ValueError):
    """Resources are missing or wrong (an unknown alias, a missing API key variable, ...)."""
