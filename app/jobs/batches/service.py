"""The OpenAI Batch API on top of jobs.

A batch is a job of kind ``batch`` whose items are the lines of its input file, each run by the one-call
pipeline :class:`app.jobs.batches.pipeline.BatchRequest` (``BatchEmbeddingRequest`` for ``/v1/embeddings``). The batch row adds what OpenAI's batch object has and a
job has not: the endpoint, the completion window, validation errors, and the output and error files.

Batches move on when they are read (``GET``, list, cancel), whichever process runs their job: a batch whose job
has ended is finalised (its output and error files are written, keyed by ``custom_id``), and a batch whose
completion window has passed has its job cancelled and ends ``expired``. Reading locks the batch row, so two
readers never finalise the same batch twice.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy.orm import Session

from app.db import (
    BATCH_FINAL,
    JOB_TERMINAL,
    Batch,
    BatchStatus,
    Item,
    ItemStatus,
    Job,
    JobStatus,
    repository,
    to_unix,
    utcnow,
)
from app.jobs.batches.pipeline import BATCH_EMBEDDING_PIPELINE, BATCH_PIPELINE
from app.jobs.errors import InvalidJobInput, JobConflict, JobNotFound
from app.jobs.files import BATCH, store_output_file
from app.jobs.files.batch_lines import (
    CHAT_COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    BatchFileError,
    LineProblem,
    check_lines,
    item_of,
    parse_request_lines,
)
from app.jobs.ids import new_batch_id
from app.jobs.submission import JobRequest, Limits, submit_job

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_PAGE = 100
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
RESULTS_PAGE = 1000


@dataclass
class BatchCreate:
    """The body of ``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


# -- creation -------------------------------------------------------------------------------------------------
def create_batch(session: Session, request: BatchCreate, *, owner: str, limits: Limits,
                 embeddings_missing: str | None = None) -> dict[str, Any]:
    """Validate the request and its input file, then write the batch and its job in the caller's transaction.

    A bad request (unknown endpoint or window, a file that is missing or not a batch file, ``/v1/embeddings``
    where ``embeddings_missing`` says why this server has no embeddings) raises and writes nothing. A file whose
    lines do not fit the endpoint gives a ``failed`` batch whose ``errors`` name the lines.
    """
    _check_request(request)
    if request.endpoint == EMBEDDINGS and embeddings_missing is not None:
        raise InvalidJobInput(f"endpoint {EMBEDDINGS} cannot run: {embeddings_missing}", param="endpoint",
                              code="embeddings_unavailable")
    file = repository.get_file(session, file_id=request.input_file_id, owner=owner)
    if file is None:
        raise InvalidJobInput(f"no file {request.input_file_id!r}: upload the requests with POST /v1/files "
                              "(purpose 'batch') first", param="input_file_id", code="file_not_found")
    if file.purpose != BATCH:
        raise InvalidJobInput(f"file {file.id} has purpose {file.purpose!r}; a batch reads a file uploaded with "
                              "purpose 'batch'", param="input_file_id", code="invalid_file")
    now = utcnow()
    fields: dict[str, Any] = {
        "batch_id": new_batch_id(), "owner": owner, "endpoint": request.endpoint,
        "completion_window": request.completion_window, "input_file_id": file.id,
        "metadata": request.metadata, "created_at": now,
        "expires_at": now + COMPLETION_WINDOWS[request.completion_window],
    }
    try:
        lines = parse_request_lines(bytes(file.content))
        problems = check_lines(lines, request.endpoint)
    except BatchFileError as exc:
        problems = [LineProblem("invalid_file", exc.message, exc.line or 0, exc.param)]
    if problems:
        errors = {"object": "list", "data": [p.as_error() for p in problems]}
        batch = repository.create_batch(session, **fields, status=BatchStatus.FAILED, errors=errors)
        return batch_view(batch, None)
    items = [item_of(line, request.endpoint) for line in lines]
    job, _ = submit_job(
        session, JobRequest(pipeline=BATCH_EMBEDDING_PIPELINE if request.endpoint == EMBEDDINGS else BATCH_PIPELINE,
                            inputs=items, metadata={"batch_id": fields["batch_id"]}),
        owner=owner, limits=limits, kind="batch", expires_at=fields["expires_at"],
    )
    job.input_file_id = file.id
    batch = repository.create_batch(session, **fields, job_id=job.id)
    return batch_view(batch, job)


def _check_request(request: BatchCreate) -> None:
    if request.endpoint not in ENDPOINTS:
        raise InvalidJobInput(f"endpoint {request.endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                              param="endpoint")
    if request.completion_window not in COMPLETION_WINDOWS:
        raise InvalidJobInput(f"completion_window must be {', '.join(map(repr, COMPLETION_WINDOWS))}, not "
                              f"{request.completion_window!r}", param="completion_window")
    metadata = request.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidJobInput(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_PAIRS} are allowed",
                              param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidJobInput(f"metadata key {key[:80]!r}: keys may have {MAX_METADATA_KEY} characters and "
                                  f"values {MAX_METADATA_VALUE}", param="metadata")


# -- reading, which also moves batches on -------------------------------------------------------------------------
def describe_batch(session: Session, batch_id: str, owner: str | None = None) -> dict[str, Any]:
    batch, job = _load(session, batch_id, owner)
    job = _advance(session, batch, job)
    return batch_view(batch, job)


def list_batch_views(
    session: Session, *, owner: str | None = None, after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    """A page of batches, newest first: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidJobInput(f"limit must be between 1 and {MAX_PAGE}, not {limit}", param="limit")
    rows = repository.list_batches(session, owner=owner, after=after, limit=limit + 1)
    page = rows[:limit]
    views = []
    for batch, job in page:
        if batch.status not in BATCH_FINAL and job is not None:
            batch, job = _load(session, batch.id, owner)
            job = _advance(session, batch, job)
        views.append(batch_view(batch, job))
    return {
        "object": "list",
        "data": views,
        "first_id": views[0]["id"] if views else None,
        "last_id": views[-1]["id"] if views else None,
        "has_more": len(rows) > limit,
    }


def cancel_batch(session: Session, batch_id: str, owner: str | None = None) -> dict[str, Any]:
    """Ask the batch to stop: ``cancelling`` at once, ``cancelled`` (with the results of the requests that had
    finished in its output and error files) once its job has stopped. Cancelling twice is harmless."""
    batch, job = _load(session, batch_id, owner)
    job = _advance(session, batch, job)
    status = batch_status(batch, job)
    if status == BatchStatus.CANCELLING:
        return batch_view(batch, job)
    if job is None or status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        raise JobConflict(f"batch {batch_id} is {status}; only a validating or in-progress batch can be cancelled",
                          param="batch_id", code="batch_not_cancellable")
    repository.mark_batch_cancelling(session, batch=batch, at=utcnow())
    repository.request_cancel(session, job_id=job.id)
    return batch_view(batch, repository.get_job(session, job_id=job.id))


def _load(session: Session, batch_id: str, owner: str | None) -> tuple[Batch, Job | None]:
    found = repository.get_batch(session, batch_id=batch_id, owner=owner, for_update=True)
    if found is None:
        raise JobNotFound(f"no batch {batch_id!r}: list your batches with GET /v1/batches", param="batch_id",
                          code="batch_not_found")
    return found


def _advance(session: Session, batch: Batch, job: Job | None) -> Job | None:
    """Expire a batch past its window, finalise one whose job has ended; returns the job as it now is."""
    if batch.status in BATCH_FINAL or job is None:
        return job
    now = utcnow()
    if job.status in JOB_TERMINAL:
        _finalize(session, batch, job, now)
    elif batch.expires_at is not None and _aware(batch.expires_at) <= now and batch.expired_at is None:
        repository.mark_batch_expired(session, batch=batch, at=now)
        if repository.request_cancel(session, job_id=job.id):  # the executor stops it within a poll interval
            job = repository.get_job(session, job_id=job.id)
    return job


# -- finalisation ---------------------------------------------------------------------------------------------
def _finalize(session: Session, batch: Batch, job: Job, now: datetime) -> None:
    outputs: list[bytes] = []
    errors: list[bytes] = []
    expired = batch.expired_at is not None
    created = to_unix(job.finished_at) or to_unix(now) or 0
    cursor = 0
    while True:
        page = repository.results_after(session, job_id=job.id, cursor=cursor, limit=RESULTS_PAGE)
        if not page:
            break
        for item in page:
            if item.status == ItemStatus.COMPLETED:
                outputs.append(orjson.dumps(output_line(batch, item, created)))
            else:
                errors.append(orjson.dumps(error_line(batch, item, expired)))
        cursor = page[-1].result_seq or cursor
    output_file = _store(session, batch, "output", outputs)
    error_file = _store(session, batch, "error", errors)
    status, batch_errors = _final_status(job, expired)
    repository.finish_batch(
        session, batch=batch, status=status, at=now, finalizing_at=job.finished_at or now,
        output_file_id=output_file, error_file_id=error_file, errors=batch_errors,
    )


def _store(session: Session, batch: Batch, kind: str, lines: list[bytes]) -> str | None:
    if not lines:
        return None  # as OpenAI: no file when no request ended that way
    content = b"\n".join(lines) + b"\n"
    return store_output_file(session, filename=f"{batch.id}_{kind}.jsonl", content=content, owner=batch.owner).id


def _final_status(job: Job, expired: bool) -> tuple[BatchStatus, dict[str, Any] | None]:
    if job.status == JobStatus.CANCELLED:
        return (BatchStatus.EXPIRED if expired else BatchStatus.CANCELLED), None
    error = job.error or {}
    if job.status == JobStatus.FAILED and error.get("type") != "AllItemsFailed":
        # the batch could not run at all (its model is not available): every line is in the error file
        entry = {"code": _code(str(error.get("type") or "Error")), "message": str(error.get("message") or ""),
                 "param": None, "line": None}
        return BatchStatus.FAILED, {"object": "list", "data": [entry]}
    return BatchStatus.COMPLETED, None  # some or all lines may have failed: each is in the error file


def _request_ids(batch: Batch, custom_id: str) -> str:
    return hashlib.sha256(f"{batch.id}\x00{custom_id}".encode()).hexdigest()[:24]


def output_line(batch: Batch, item: Item, created: int) -> dict[str, Any]:
    """A line of the output file: the request's response, shaped as the endpoint answers."""
    digest = _request_ids(batch, item.custom_id)
    if batch.endpoint == EMBEDDINGS:
        return _line(item, digest, embeddings_body(item.output))
    output = item.output if isinstance(item.output, dict) else {"text": item.output, "meta": {}}
    text = output.get("text")
    text = text if isinstance(text, str) else ("" if text is None else orjson.dumps(text).decode())
    found = output.get("meta")
    meta: dict[str, Any] = found if isinstance(found, dict) else {}
    prompt_tokens, completion_tokens = int(meta.get("input_tokens") or 0), int(meta.get("output_tokens") or 0)
    model = meta.get("model") or meta.get("alias") or "default"
    finish_reason = meta.get("finish_reason") or "stop"
    body: dict[str, Any]
    if batch.endpoint == CHAT_COMPLETIONS:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = meta.get("tool_calls")
        if isinstance(calls, list) and calls:  # as OpenAI answers a call: content null unless the model said more
            message = {"role": "assistant", "content": text or None, "tool_calls": calls}
        body = {
            "id": f"chatcmpl-{digest}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        }
    else:
        body = {
            "id": f"cmpl-{digest}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        }
    body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
    return _line(item, digest, body)


def _line(item: Item, digest: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{digest}",
        "custom_id": item.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{digest}", "body": body},
        "error": None,
    }


def embeddings_body(output: Any) -> dict[str, Any]:
    """OpenAI's ``/v1/embeddings`` response for a ``BatchEmbeddingRequest`` output (``{"embeddings", "meta",
    "encoding_format"}``): one vector per input, base64 little-endian float32 when the line asked for it."""
    output = output if isinstance(output, dict) else {}
    vectors = output.get("embeddings")
    if vectors and not isinstance(vectors[0], list):
        vectors = [vectors]  # one input: one vector
    found = output.get("meta")
    meta: dict[str, Any] = found if isinstance(found, dict) else {}
    encoding = output.get("encoding_format") or "float"
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, encoding)}
            for i, vector in enumerate(vectors or [])]
    tokens = int(meta.get("input_tokens") or 0)
    return {"object": "list", "data": data, "model": meta.get("model") or meta.get("alias") or "default",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding != "base64":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def error_line(batch: Batch, item: Item, expired: bool) -> dict[str, Any]:
    """A line of the error file: why the request has no response."""
    error = item.error or {}
    kind = str(error.get("type") or "Error")
    message = str(error.get("message") or "the request failed")
    if item.status == ItemStatus.CANCELLED:
        if expired:
            code, message = "batch_expired", "the batch's completion window ended before this request ran"
        else:
            code, message = "batch_cancelled", "the batch was cancelled before this request ran"
    else:
        code = _code(kind)
    return {
        "id": f"batch_req_{_request_ids(batch, item.custom_id)}",
        "custom_id": item.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def _code(kind: str) -> str:
    """An error type name as a machine-readable code: ``ResourceError`` → ``resource_error``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", kind).lower()


# -- the view -------------------------------------------------------------------------------------------------
def batch_status(batch: Batch, job: Job | None) -> BatchStatus:
    """The stored status once final; before that, what the batch's job is doing."""
    if batch.status in BATCH_FINAL or job is None:
        return BatchStatus(batch.status)
    if job.status == JobStatus.QUEUED:
        return BatchStatus.VALIDATING
    if job.status == JobStatus.RUNNING:
        return BatchStatus.IN_PROGRESS
    if job.status == JobStatus.CANCELLING and batch.expired_at is None:
        return BatchStatus.CANCELLING
    return BatchStatus.FINALIZING  # the job has ended (or is stopping at the window's end): files come next


def batch_view(batch: Batch, job: Job | None) -> dict[str, Any]:
    """The batch object exactly as OpenAI's API returns it."""
    status = batch_status(batch, job)
    finalizing_at = batch.finalizing_at
    if finalizing_at is None and status == BatchStatus.FINALIZING and job is not None:
        finalizing_at = job.finished_at
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch.errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": status.value,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": to_unix(batch.created_at),
        "in_progress_at": to_unix(job.started_at) if job is not None else None,
        "expires_at": to_unix(batch.expires_at),
        "finalizing_at": to_unix(finalizing_at),
        "completed_at": to_unix(batch.completed_at),
        "failed_at": to_unix(batch.failed_at),
        "expired_at": to_unix(batch.expired_at) if status == BatchStatus.EXPIRED else None,
        "cancelling_at": to_unix(batch.cancelling_at),
        "cancelled_at": to_unix(batch.cancelled_at),
        "request_counts": {
            "total": job.total_items if job is not None else 0,
            "completed": job.completed_items if job is not None else 0,
            "failed": job.failed_items if job is not None else 0,
        },
        "metadata": batch.metadata_,
    }


def _aware(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; they are UTC
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
