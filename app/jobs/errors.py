"""Domain errors of the job layer. Each names its kind; the API maps kinds to HTTP statuses."""

from __future__ import annotations


class JobError(Exception):
    """Base of the job layer's errors. ``param`` names the request field at fault, when there is one."""

    kind = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidJobInput(JobError):
    """Unknown pipeline, a bad JSONL line, a duplicate custom_id, an item that does not fit the pipeline."""

    kind = "invalid_request"


class PayloadTooLarge(JobError):
    """More items or bytes than the configured limits allow."""

    kind = "too_large"


class JobNotFound(JobError):
    kind = "not_found"


class JobConflict(JobError):
    """The request does not fit the job's state (e.g. cancelling a finished job)."""

    kind = "conflict"


class QuotaExceeded(JobError):
    """The tenant's quota would be exceeded (e.g. ``tenant_max_queued_items``); asking again later may pass, so
    the API answers 429 with ``Retry-After: retry_after_s``."""

    kind = "quota_exceeded"
    retry_after_s = 5
