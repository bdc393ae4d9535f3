"""``/v1/batches``: the OpenAI Batch API (create, retrieve, list, cancel); each batch runs as a job.

Routes only parse, authorise and shape; the work is in ``app.jobs.batches``. Database calls run in the thread
pool.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from pydantic import ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.deps import require_api_key
from api.params import RequestBody
from api.responses import JSONBytes
from api.routes.jobs import Owner, Runtime
from app.jobs import batches

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["batches"])


class BatchBody(RequestBody):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


@router.post("/batches")
async def create_batch(body: BatchBody, runtime: Runtime, owner: Owner) -> Response:
    request = batches.BatchCreate(input_file_id=body.input_file_id, endpoint=body.endpoint,
                                  completion_window=body.completion_window, metadata=body.metadata)

    def work() -> dict[str, Any]:
        with runtime.session() as session:
            return batches.create_batch(session, request, owner=owner, limits=runtime.limits)

    view = await run_in_threadpool(work)
    runtime.wake()
    return JSONBytes(view)


@router.get("/batches")
async def list_batches(
    runtime: Runtime,
    owner: Owner,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=batches.MAX_PAGE)] = 20,
) -> Response:
    def work() -> dict[str, Any]:
        with runtime.session() as session:
            return batches.list_batch_views(session, owner=owner, after=after, limit=limit)

    return JSONBytes(await run_in_threadpool(work))


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: str, runtime: Runtime, owner: Owner) -> Response:
    def work() -> dict[str, Any]:
        with runtime.session() as session:
            return batches.describe_batch(session, batch_id, owner)

    return JSONBytes(await run_in_threadpool(work))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, runtime: Runtime, owner: Owner) -> Response:
    def work() -> dict[str, Any]:
        with runtime.session() as session:
            return batches.cancel_batch(session, batch_id, owner)

    view = await run_in_threadpool(work)
    runtime.wake()
    return JSONBytes(view)
