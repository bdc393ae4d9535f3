"""``/v1/jobs``: submit a pipeline job, read it, list, cancel, stream its results (NDJSON), get its trace.

Routes only parse, authorise and shape; the work is in ``app.jobs``. Database calls run in the thread pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import AliasChoices, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from api.deps import get_owner, require_api_key
from api.params import RequestBody, ResultsCursor
from api.responses import JSONBytes, content_disposition, dumps
from app.jobs import service
from app.jobs.embedded.runtime import JobsRuntime
from app.jobs.errors import InvalidJobInput, JobNotFound, PayloadTooLarge
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


async def jobs_runtime(request: Request) -> JobsRuntime:
    runtime: JobsRuntime = request.app.state.jobs
    await runtime.ensure_started()
    return runtime


Runtime = Annotated[JobsRuntime, Depends(jobs_runtime)]
Owner = Annotated[str, Depends(get_owner)]


# the route reads its body itself (to bound its size first): the schema documents it
_JOB_BODY = {"required": True, "content": {"application/json": {"schema": JobCreate.model_json_schema()}}}


@router.post("/jobs", status_code=201, openapi_extra={"requestBody": _JOB_BODY})
async def create_job(
    request: Request,
    runtime: Runtime,
    owner: Owner,
    idempotency_header: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    body = await _read_body(request, runtime.limits.max_bytes)
    payload = await run_in_threadpool(_parse_job, body)  # a large body takes a while: off the event loop
    job_request = JobRequest(
        pipeline=payload.pipeline, inputs=payload.inputs, input_file_id=payload.input_file_id,
        priority=payload.priority, metadata=payload.metadata,
        idempotency_key=payload.idempotency_key or idempotency_header,
    )

    def submit() -> tuple[dict[str, Any], bool]:
        with runtime.session() as session:
            job, created = submit_job(session, job_request, owner=owner, limits=runtime.limits)
            return service.describe_job(session, job.id), created

    view, created = await run_in_threadpool(submit)
    if created:
        runtime.wake()
    # a replay answers exactly like the first request did, and says that it is one
    headers = {"Location": f"/v1/jobs/{view['id']}"}
    if not created:
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


@router.get("/jobs")
async def list_jobs(
    runtime: Runtime,
    owner: Owner,
    status: Annotated[str | None, Query(description="Only these statuses (comma-separated)")] = None,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=service.MAX_PAGE)] = 20,
) -> Response:
    def work() -> dict[str, Any]:
        with runtime.session() as session:
            return service.list_job_views(session, owner=owner, status=status, after=after, limit=limit)

    return JSONBytes(await run_in_threadpool(work))


@router.get("/jobs/{job_id}")
async def get_job(job_id: str, runtime: Runtime, owner: Owner) -> Response:
    def work() -> dict[str, Any]:
        with runtime.session() as session:
            return service.describe_job(session, job_id, owner)

    return JSONBytes(await run_in_threadpool(work))


@router.post("/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, runtime: Runtime, owner: Owner) -> Response:
    def work() -> dict[str, Any]:
        with runtime.session() as session:
            job = service.cancel_job(session, job_id, owner)
            return service.describe_job(session, job.id, owner)

    view = await run_in_threadpool(work)
    runtime.wake()
    return JSONBytes(view)


@router.get("/jobs/{job_id}/results")
async def job_results(
    job_id: str,
    runtime: Runtime,
    owner: Owner,
    cursor: ResultsCursor = 0,
    follow: Annotated[bool, Query(description="Keep streaming new results until the job ends")] = False,
) -> Response:
    """NDJSON, one line per finished item in completion order: ``{"custom_id", "status", "output"}`` or
    ``{"custom_id", "status", "error"}``. To resume, pass the number of lines already read as ``cursor``."""

    def first_page() -> service.ResultsPage:
        with runtime.session() as session:
            return service.results_page(session, job_id, owner=owner, cursor=cursor, limit=RESULTS_PAGE)

    page = await run_in_threadpool(first_page)  # an unknown job is a 404 before the stream starts
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
async def job_trace(job_id: str, runtime: Runtime, owner: Owner) -> Response:
    """The job's Chrome Trace Event JSON (open it in Perfetto): live while the job runs in this server."""

    def stored() -> dict[str, Any] | None:
        with runtime.session() as session:
            return service.stored_trace(session, job_id, owner)

    trace = await run_in_threadpool(stored)  # also checks that the job exists and is the caller's
    live = runtime.live_trace(job_id)
    if live is not None:
        trace = live
    if trace is None:
        raise JobNotFound(f"job {job_id} has no trace yet: it has not started running", param="job_id",
                          code="trace_not_found")
    return JSONBytes(trace, headers={"Content-Disposition": content_disposition(f"{job_id}.trace.json", "inline")})
