"""``/v1/jobs``: submit a pipeline job, read it, list, cancel, stream its results (NDJSON), get its trace.

Routes only parse, authorise and shape; the work is in ``app.jobs``. Routes that read the database are plain
functions on a ``DbSession`` (FastAPI runs them in its thread pool).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import AliasChoices, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from api.deps import DbSession, Owner, Runtime, require_api_key
from api.params import DB_INT_MAX, RequestBody, ResultsCursor
from api.responses import JSONBytes, content_disposition, dumps
from api.schemas import ItemList, Job, JobList, created, ok
from app.jobs import items, service
from app.jobs.errors import InvalidJobInput, JobNotFound, PayloadTooLarge
from app.jobs.runtime import JobsRuntime
from app.jobs.submission import JobRequest, submit_job
from app.serving.errors import from_validation_errors

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["jobs"])

RESULTS_PAGE = 500
FOLLOW_POLL_SECONDS = 1.0  # followers also re-read this often: another process may be running the job


class JobCreate(RequestBody):
    """The body of ``POST /v1/jobs``."""

    model_config = ConfigDict(extra="forbid")
    data_lists = frozenset({"inputs"})

    pipeline: str = Field(min_length=1)
    inputs: list[Any] | str | None = None
    input_file_id: str | None = Field(default=None, validation_alias=AliasChoices("input_file_id", "file_id"))
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    metadata: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)


# the route reads its body itself (to bound its size first): the schema documents it
_JOB_BODY = {"required": True, "content": {"application/json": {"schema": JobCreate.model_json_schema()}}}


async def read_job(request: Request, runtime: Runtime) -> JobCreate:
    """The body of ``POST /v1/jobs``, bounded in size as it streams in and parsed off the event loop."""
    body = await _read_body(request, runtime.limits.max_bytes)
    return await run_in_threadpool(_parse_job, body)


@router.post("/jobs", status_code=201, openapi_extra={"requestBody": _JOB_BODY}, responses=created(Job))
def create_job(
    payload: Annotated[JobCreate, Depends(read_job)],
    runtime: Runtime,
    session: DbSession,
    owner: Owner,
    background: BackgroundTasks,
    idempotency_header: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    job_request = JobRequest(
        pipeline=payload.pipeline, inputs=payload.inputs, input_file_id=payload.input_file_id,
        priority=payload.priority, metadata=payload.metadata,
        idempotency_key=payload.idempotency_key or idempotency_header,
    )
    job, created = submit_job(session, job_request, owner=owner, limits=runtime.limits)
    view = service.describe_job(session, job.id)
    # a replay answers exactly like the first request did, and says that it is one
    headers = {"Location": f"/v1/jobs/{view['id']}"}
    if created:
        background.add_task(runtime.wake)  # after the commit: the executor or dispatcher finds the job
    else:
        headers["Idempotent-Replayed"] = "true"
    return JSONBytes(view, status_code=201, headers=headers)


def _parse_job(body: bytes) -> JobCreate:
    try:
        return JobCreate.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise InvalidJobInput("the request body is empty: send a JSON object with 'pipeline' and 'inputs'")
    return body


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request has {'more than ' if size > limit else ''}{size} bytes; at most {limit} are accepted "
        "(INF_ENGINE_JOBS_MAX_BYTES): upload the JSONL with POST /v1/files or split the job"
    )


@router.get("/jobs", responses=ok(JobList))
def list_jobs(
    session: DbSession,
    owner: Owner,
    status: Annotated[str | None, Query(description="Only these statuses (comma-separated)")] = None,
    pipeline: Annotated[str | None, Query(description="Only jobs of this pipeline (the name as submitted)")] = None,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_PAGE)] = 20,
) -> Response:
    """The caller's jobs, newest first, each with its ``usage`` (tokens, cost, latency)."""
    return JSONBytes(service.list_job_views(session, owner=owner, status=status, pipeline=pipeline, after=after,
                                            limit=limit))


@router.get("/jobs/{job_id}", responses=ok(Job))
def get_job(job_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(service.describe_job(session, job_id, owner))


_EXPORT_RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "description": "The matching items: JSON Lines (one items-view row per line) or CSV",
    "content": {"application/x-ndjson": {}, "text/csv": {}},
}}
ItemStatusFilter = Annotated[str | None, Query(
    description="Only items with these statuses (comma-separated: pending, running, completed, failed, cancelled)")]
ItemSearch = Annotated[str | None, Query(
    description="Only items whose custom_id, input, output or error contain this text (case-insensitive)")]
ItemOrder = Annotated[str, Query(
    description="'position' (input order) or 'failures_first' (failed, then cancelled, then the rest)")]


@router.get("/jobs/{job_id}/items", responses=ok(ItemList))
def job_items(
    job_id: str,
    session: DbSession,
    owner: Owner,
    status: ItemStatusFilter = None,
    q: ItemSearch = None,
    order: ItemOrder = "position",
    offset: Annotated[int, Query(ge=0, le=DB_INT_MAX, description="Matching items to skip")] = 0,
    limit: Annotated[int, Query(ge=1, le=items.MAX_LIMIT)] = 50,
) -> Response:
    """A page of the job's items for a table: input, output or error, status and latency of each, and how many
    items match the filters (``total``)."""
    return JSONBytes(items.items_page(session, job_id, owner=owner, status=status, q=q, order=order,
                                      offset=offset, limit=limit))


@router.get("/jobs/{job_id}/items/export", response_class=StreamingResponse, responses=_EXPORT_RESPONSES)
def export_job_items(
    job_id: str,
    runtime: Runtime,
    session: DbSession,
    owner: Owner,
    format: Annotated[str, Query(description="'jsonl' (the items view's rows) or 'csv'")] = "jsonl",
    status: ItemStatusFilter = None,
    q: ItemSearch = None,
    order: ItemOrder = "position",
) -> Response:
    """Every matching item as a download, read from the database page by page as it streams."""
    export = items.item_export(session, job_id, owner=owner, format=format, status=status, q=q, order=order)
    return StreamingResponse(export.chunks(runtime.session), media_type=export.media_type,
                             headers={"Content-Disposition": content_disposition(export.filename)})


@router.post("/jobs/{job_id}/cancel", responses=ok(Job))
def cancel_job(job_id: str, runtime: Runtime, session: DbSession, owner: Owner,
               background: BackgroundTasks) -> Response:
    job = service.cancel_job(session, job_id, owner)
    view = service.describe_job(session, job.id, owner)
    background.add_task(runtime.wake)
    return JSONBytes(view)


@router.get("/jobs/{job_id}/results")
def job_results(
    job_id: str,
    runtime: Runtime,
    session: DbSession,
    owner: Owner,
    cursor: ResultsCursor = 0,
    follow: Annotated[bool, Query(description="Keep streaming new results until the job ends")] = False,
) -> Response:
    """NDJSON, one line per finished item in completion order: ``{"custom_id", "status", "output"}`` or
    ``{"custom_id", "status", "error"}``. To resume, pass the number of lines already read as ``cursor``."""

    # an unknown job is a 404 before the stream starts; later pages read on their own sessions
    page = service.results_page(session, job_id, owner=owner, cursor=cursor, limit=RESULTS_PAGE)
    return StreamingResponse(
        _stream_results(runtime, job_id, owner, page, follow),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _stream_results(
    runtime: JobsRuntime, job_id: str, owner: str, page: service.ResultsPage, follow: bool
) -> AsyncIterator[bytes]:
    while True:
        if page.lines:
            yield b"".join(dumps(line) + b"\n" for line in page.lines)
        if page.finished:
            return
        if len(page.lines) < RESULTS_PAGE:  # caught up with what is stored
            if not follow:
                return
            token = runtime.events.watch(job_id)  # before reading, so a commit in between is not missed
            page = await _read_page(runtime, job_id, owner, page.cursor)
            if page.lines or page.finished:
                continue
            await runtime.events.wait(token, FOLLOW_POLL_SECONDS)
        page = await _read_page(runtime, job_id, owner, page.cursor)


async def _read_page(runtime: JobsRuntime, job_id: str, owner: str, cursor: int) -> service.ResultsPage:
    def work() -> service.ResultsPage:
        with runtime.session() as session:
            return service.results_page(session, job_id, owner=owner, cursor=cursor, limit=RESULTS_PAGE)

    return await run_in_threadpool(work)


@router.get("/jobs/{job_id}/trace")
def job_trace(job_id: str, runtime: Runtime, session: DbSession, owner: Owner) -> Response:
    """The job's Chrome Trace Event JSON (open it in Perfetto): live while the job runs in this server."""
    trace = service.stored_trace(session, job_id, owner)  # also checks that the job exists and is the caller's
    live = runtime.live_trace(session, job_id)
    if live is not None:
        trace = live
    if trace is None:
        raise JobNotFound(f"job {job_id} has no trace yet: it has not started running", param="job_id",
                          code="trace_not_found")
    return JSONBytes(trace, headers={"Content-Disposition": content_disposition(f"{job_id}.trace.json", "inline")})
