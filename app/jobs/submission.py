"""Submitting a job: validate the pipeline and every input, then write the job, its items and the traced
graph in the caller's transaction. Any validation error is raised before the caller commits, so a rejected
submission writes nothing."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db import Job, repository
from app.jobs.encoding import encode_item_input
from app.jobs.errors import InvalidJobInput, JobConflict, PayloadTooLarge, QuotaExceeded
from app.jobs.graphs import graph_forms, import_path_of, load_module, shape_key, trace_item
from app.jobs.ids import new_job_id
from app.jobs.inputs import BatchItem, InputFileError, parse_item, parse_jsonl
from app.jobs.limits.quotas import QuotaTable, admit_items
from app.jobs.registry import UnknownPipelineError, load_pipeline_class


@dataclass
class JobRequest:
    """What ``POST /v1/jobs`` carries. ``inputs`` is a list of items (JSONL line values) or JSONL text."""

    pipeline: str
    inputs: list[Any] | str | None = None
    input_file_id: str | None = None
    priority: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None


@dataclass(frozen=True)
class Limits:
    max_items: int = 100_000
    max_bytes: int = 100 * 1024 * 1024
    quotas: QuotaTable = field(default_factory=QuotaTable)  # per tenant; the default has none


def submit_job(
    session: Session,
    request: JobRequest,
    *,
    owner: str = "anonymous",
    limits: Limits | None = None,
    kind: str = "pipeline",
    expires_at: datetime | None = None,
) -> tuple[Job, bool]:
    """``(job, created)``. A known idempotency key returns the job it created first, with ``created`` False."""
    limits = limits or Limits()
    fingerprint = request_fingerprint(request)
    if request.idempotency_key:
        existing = repository.find_job_by_idempotency_key(session, owner=owner, key=request.idempotency_key)
        if existing is not None:
            return _same_request(existing, request, fingerprint), False
    import_path = _check_pipeline(request.pipeline)
    items = _read_items(session, request, owner, limits)
    pipeline = repository.get_or_create_pipeline(session, owner=owner, name=import_path, import_path=import_path)
    graph_hashes = _trace_items(session, pipeline, request.pipeline, items)
    try:
        admit_items(session, tenant=owner, adding=len(items), quotas=limits.quotas)
    except QuotaExceeded:
        # a twin with the same idempotency key committed while this one waited for the tenant's lock: its job
        # is the answer, not a refusal
        twin = _job_of_key(session, owner, request.idempotency_key)
        if twin is None:
            raise
        return _same_request(twin, request, fingerprint), False
    job_id = new_job_id()
    try:
        with session.begin_nested():  # a concurrent twin with the same idempotency key loses here
            job = repository.create_job(
                session, job_id=job_id, pipeline_id=pipeline.id, pipeline_name=request.pipeline,
                total_items=len(items), priority=request.priority, metadata=request.metadata,
                idempotency_key=request.idempotency_key or None, request_hash=fingerprint, owner=owner,
                input_file_id=request.input_file_id, kind=kind, expires_at=expires_at,
            )
    except IntegrityError:
        existing = _job_of_key(session, owner, request.idempotency_key)
        if existing is None:
            raise
        return _same_request(existing, request, fingerprint), False
    rows = [
        {"custom_id": item.custom_id, "position": position, "input": encode_item_input(item),
         "graph_hash": graph_hashes[position]}
        for position, item in enumerate(items)
    ]
    repository.add_items(session, job_id=job.id, rows=rows)
    return job, True


def _job_of_key(session: Session, owner: str, key: str | None) -> Job | None:
    return repository.find_job_by_idempotency_key(session, owner=owner, key=key) if key else None


def request_fingerprint(request: JobRequest) -> str:
    """A hash of everything an idempotency key stands for (Stripe's rule: the same key means the same body)."""
    body = {"pipeline": request.pipeline, "inputs": request.inputs, "input_file_id": request.input_file_id,
            "priority": request.priority, "metadata": request.metadata}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _same_request(job: Job, request: JobRequest, fingerprint: str) -> Job:
    # jobs stored before request hashes existed are compared by pipeline only
    differs = job.request_hash != fingerprint if job.request_hash else job.pipeline_name != request.pipeline
    if differs:
        raise JobConflict(
            f"the idempotency key {request.idempotency_key!r} was already used for job {job.id} with a different "
            "request body; send the same body to get that job back, or use a new key for a new submission",
            param="idempotency_key", code="idempotency_key_reused",
        )
    return job


def _check_pipeline(name: str) -> str:
    if not name or not name.strip():
        raise InvalidJobInput("pipeline is required: the name of a registered pipeline", param="pipeline")
    try:
        load_pipeline_class(name)
    except UnknownPipelineError as exc:
        raise InvalidJobInput(str(exc), param="pipeline", code="unknown_pipeline") from None
    return import_path_of(name)


def _read_items(session: Session, request: JobRequest, owner: str, limits: Limits) -> list[BatchItem]:
    given = [name for name, value in (("inputs", request.inputs), ("input_file_id", request.input_file_id))
             if value not in (None, "")]
    if len(given) != 1:
        raise InvalidJobInput(
            "give the items either inline as 'inputs' (a list, or JSONL text) or as 'input_file_id' (an uploaded "
            "JSONL file), exactly one of them",
            param="inputs",
        )
    try:
        if request.input_file_id:
            items = _items_from_file(session, request.input_file_id, owner, limits)
        elif isinstance(request.inputs, str):
            items = parse_jsonl(request.inputs, source="inputs")
        else:
            items = _items_from_list(request.inputs or [])
    except InputFileError as exc:
        raise InvalidJobInput(str(exc), param=given[0], code="invalid_input") from None
    if len(items) > limits.max_items:
        raise PayloadTooLarge(
            f"the job has {len(items)} items; at most {limits.max_items} are accepted (INF_ENGINE_JOBS_MAX_ITEMS): "
            "split it into several jobs",
            param=given[0],
        )
    return items


def _items_from_list(values: list[Any]) -> list[BatchItem]:
    if not values:
        raise InputFileError("inputs has no items")
    items: list[BatchItem] = []
    seen: set[str] = set()
    for index, value in enumerate(values):
        try:
            item = parse_item(value, default_id=str(index + 1))
        except ValueError as exc:
            raise InputFileError(f"inputs[{index}]: {exc}") from None
        if item.custom_id in seen:
            raise InputFileError(f"inputs[{index}]: duplicate custom_id {item.custom_id!r}")
        seen.add(item.custom_id)
        items.append(item)
    return items


def _items_from_file(session: Session, file_id: str, owner: str, limits: Limits) -> list[BatchItem]:
    file = repository.get_file(session, file_id=file_id, owner=owner)
    if file is None:
        raise InvalidJobInput(f"no uploaded file {file_id!r}: upload the JSONL with POST /v1/files first",
                              param="input_file_id", code="file_not_found")
    if file.bytes > limits.max_bytes:
        raise PayloadTooLarge(
            f"file {file_id} has {file.bytes} bytes; at most {limits.max_bytes} are accepted "
            "(INF_ENGINE_JOBS_MAX_BYTES)",
            param="input_file_id",
        )
    try:
        text = bytes(file.content).decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"file {file_id} is not UTF-8 text") from None
    return parse_jsonl(text, source=f"file {file_id}")


def _trace_items(session: Session, pipeline: Any, name: str, items: list[BatchItem]) -> list[str]:
    """Trace one item per input shape (items of one shape share a graph); every item must fit the pipeline's
    forward. Returns each item's graph hash and stores each new graph."""
    try:
        module = load_module(name, pipeline.parameter_state)
    except UnknownPipelineError as exc:
        raise InvalidJobInput(str(exc), param="pipeline", code="unknown_pipeline") from None
    by_shape: dict[Any, str] = {}
    hashes: list[str] = []
    for item in items:
        key = shape_key((item.args, item.kwargs))
        graph_hash = by_shape.get(key)
        if graph_hash is None:
            try:
                graph = trace_item(module, item.args, item.kwargs)
                graph_hash, document, rows = graph_forms(graph)
            except Exception as exc:
                raise InvalidJobInput(
                    f"item {item.custom_id!r} does not fit pipeline {name!r}: {type(exc).__name__}: {exc}",
                    param="inputs", code="invalid_input",
                ) from None
            repository.record_graph(session, pipeline=pipeline, graph_hash=graph_hash, graph=document, nodes=rows)
            by_shape[key] = graph_hash
        hashes.append(graph_hash)
    return hashes
