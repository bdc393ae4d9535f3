"""Jobs and their items (``app.jobs.service.job_view``, ``app.jobs.items.item_view``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.client.types.common import ItemStatus, JobStatus, Page, Unix


class JobCounts(BaseModel):
    total: int
    completed: int
    failed: int
    cancelled: int
    pending: int = Field(description="Items not finished yet (queued or running)")


class JobUsage(BaseModel):
    """The job's LLM calls so far: tokens, cost and latency."""

    llm_calls: int
    input_tokens: int
    output_tokens: int
    total_tokens: int
    cost: float
    latency_ms_avg: float | None = Field(description="null before the first call")
    latency_ms_max: float | None


class Job(BaseModel):
    """A pipeline job."""

    id: str
    object: Literal["job"]
    pipeline: str = Field(description="The pipeline's name as submitted")
    status: JobStatus
    priority: int
    metadata: dict[str, Any]
    idempotency_key: str | None
    input_file_id: str | None
    counts: JobCounts
    error: dict[str, Any] | None
    created_at: Unix
    started_at: Unix | None
    cancelling_at: Unix | None
    cancelled_at: Unix | None
    completed_at: Unix | None
    failed_at: Unix | None
    finished_at: Unix | None
    usage: JobUsage | None = Field(default=None, description="Present once the job's metrics exist (from its "
                                                             "creation on)")


class JobList(Page):
    data: list[Job]


class ItemRow(BaseModel):
    """One item of a job, as a table shows it."""

    custom_id: str
    position: int = Field(description="Its place in the job's input, from 0")
    status: ItemStatus
    input: Any = Field(description="What was submitted as the item's input")
    output: Any = Field(description="The pipeline's output (null unless completed)")
    error: dict[str, Any] | None = Field(description="type and message of a failed or cancelled item")
    latency_ms: float | None = Field(description="From start to finish; null until both are known")
    started_at: Unix | None
    finished_at: Unix | None


class ItemList(BaseModel):
    """A page of a job's items."""

    object: Literal["list"]
    data: list[ItemRow]
    total: int = Field(description="Items that match the filters")
    offset: int
    limit: int
    has_more: bool


class JobResult(BaseModel):
    """One NDJSON line of ``GET /v1/jobs/{id}/results``: a finished item, in completion order (the shape
    ``inf-engine run`` writes too)."""

    custom_id: str
    status: ItemStatus
    output: Any = Field(default=None, description="The pipeline's output (completed items)")
    error: dict[str, Any] | None = Field(default=None, description="type and message (failed or cancelled items)")

    @property
    def ok(self) -> bool:
        return self.status == ItemStatus.COMPLETED
