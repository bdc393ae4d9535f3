"""What the response models share: times, the page fields of listings and the status enums.

The statuses repeat the values of the database's enums (``app.db.models``) without importing them, so that the
client needs no SQLAlchemy; ``tests/unit/client/test_types.py`` checks that the two agree."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel

#: a time in seconds since the epoch (UTC), as every view gives times
Unix = int


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


class ItemStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class BatchStatus(StrEnum):
    """OpenAI's batch statuses."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class RunStatus(StrEnum):
    """The life of a training or an evaluation."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


#: the statuses after which a job, a training or an evaluation changes no more
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


class Page(BaseModel):
    """A page of a listing, newest first; ``after=last_id`` asks for the next one."""

    object: Literal["list"]
    first_id: str | None
    last_id: str | None
    has_more: bool
