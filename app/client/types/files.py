"""Files and batches as OpenAI's API has them (``app.jobs.files.file_view``, ``app.jobs.batches.service``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from app.client.types.common import BatchStatus, Page, Unix


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: Unix
    expires_at: Unix | None
    filename: str
    purpose: str
    status: str
    status_details: Any


class FileList(Page):
    data: list[FileObject]


class DeletedFile(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: Unix
    in_progress_at: Unix | None
    expires_at: Unix | None
    finalizing_at: Unix | None
    completed_at: Unix | None
    failed_at: Unix | None
    expired_at: Unix | None
    cancelling_at: Unix | None
    cancelled_at: Unix | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(Page):
    data: list[Batch]
