"""Uploaded files, as OpenAI's ``/v1/files`` has them: batch request files, job input files, batch results.

Uploads are checked before anything is stored: a ``batch`` file must hold one Batch API request per line (see
:mod:`app.jobs.files.batch_lines`), a ``user_data`` file one job item per line (the JSONL of ``POST /v1/jobs``).
The files a batch writes (its output and error files) have purpose ``batch_output``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.db import File, repository, to_unix
from app.jobs.errors import InvalidJobInput, JobNotFound, PayloadTooLarge
from app.jobs.files.batch_lines import BatchFileError, parse_request_lines
from app.jobs.ids import new_file_id
from app.jobs.inputs import InputFileError, parse_jsonl
from app.jobs.submission import Limits

BATCH = "batch"
USER_DATA = "user_data"
BATCH_OUTPUT = "batch_output"
UPLOAD_PURPOSES = (BATCH, USER_DATA)
MAX_LIST = 10_000  # OpenAI's largest page of files


def upload_file(
    session: Session, *, filename: str, purpose: str, content: bytes, owner: str, limits: Limits
) -> File:
    """Check and store an upload; any problem raises before a row is written."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidJobInput(
            f"purpose {purpose!r} is not accepted here; use 'batch' for Batch API request files or 'user_data' for "
            "the JSONL inputs of POST /v1/jobs",
            param="purpose",
        )
    if len(content) > limits.max_bytes:
        raise PayloadTooLarge(
            f"the file has {len(content)} bytes; at most {limits.max_bytes} are accepted (INF_ENGINE_JOBS_MAX_BYTES): "
            "split it into several files",
            param="file",
        )
    count = _check_content(purpose, content)
    if count > limits.max_items:
        raise PayloadTooLarge(
            f"the file has {count} lines; at most {limits.max_items} are accepted (INF_ENGINE_JOBS_MAX_ITEMS): "
            "split it into several files",
            param="file",
        )
    name = (filename or "").strip() or "upload.jsonl"
    return repository.create_file(session, file_id=new_file_id(), purpose=purpose, filename=name[:500],
                                  content=content, owner=owner)


def _check_content(purpose: str, content: bytes) -> int:
    """The number of lines of a valid upload; an invalid one raises ``InvalidJobInput`` naming the line."""
    if purpose == BATCH:
        try:
            return len(parse_request_lines(content))
        except BatchFileError as exc:
            raise InvalidJobInput(f"invalid batch file: {exc.message}", param="file", code="invalid_file") from None
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidJobInput("the file is not UTF-8 text", param="file", code="invalid_file") from None
    try:
        return len(parse_jsonl(text, source="the file"))
    except InputFileError as exc:
        raise InvalidJobInput(str(exc), param="file", code="invalid_file") from None


def store_output_file(session: Session, *, filename: str, content: bytes, owner: str) -> File:
    """A file the platform writes (a batch's output or error file)."""
    return repository.create_file(session, file_id=new_file_id(), purpose=BATCH_OUTPUT, filename=filename,
                                  content=content, owner=owner)


def file_view(file: File) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": to_unix(file.created_at),
        "expires_at": None,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def load_file(session: Session, file_id: str, owner: str | None, *, with_content: bool = False) -> File:
    file = repository.get_file(session, file_id=file_id, owner=owner, with_content=with_content)
    if file is None:
        raise JobNotFound(f"no file {file_id!r}: list your files with GET /v1/files", param="file_id",
                          code="file_not_found")
    return file


def describe_file(session: Session, file_id: str, owner: str | None = None) -> dict[str, Any]:
    return file_view(load_file(session, file_id, owner))


@dataclass(frozen=True)
class FileContent:
    filename: str
    content: bytes


def file_content(session: Session, file_id: str, owner: str | None = None) -> FileContent:
    file = load_file(session, file_id, owner, with_content=True)
    return FileContent(file.filename, bytes(file.content))


def list_file_views(
    session: Session,
    *,
    owner: str | None = None,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = MAX_LIST,
    order: str = "desc",
) -> dict[str, Any]:
    """A page of files: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidJobInput(f"limit must be between 1 and {MAX_LIST}, not {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidJobInput(f"order must be 'asc' or 'desc', not {order!r}", param="order")
    files = repository.list_files(session, owner=owner, purpose=purpose or None, after=after, limit=limit + 1,
                                  newest_first=order == "desc")
    page = files[:limit]
    return {
        "object": "list",
        "data": [file_view(f) for f in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(files) > limit,
    }


def delete_file(session: Session, file_id: str, owner: str | None = None) -> dict[str, Any]:
    if not repository.delete_file(session, file_id=file_id, owner=owner):
        raise JobNotFound(f"no file {file_id!r}: list your files with GET /v1/files", param="file_id",
                          code="file_not_found")
    return {"id": file_id, "object": "file", "deleted": True}
