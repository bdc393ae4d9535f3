"""``/v1/batches``: the OpenAI Batch API (create, retrieve, list, cancel); each batch runs as a job.

Routes only parse, authorise and shape; the work is in ``app.jobs.batches.service``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Depends, Query, Response
from pydantic import ConfigDict, Field

from api.deps import DbSession, Owner, Runtime, require_api_key
from api.params import RequestBody
from api.responses import JSONBytes
from api.schemas import Batch, BatchList, ok
from app.jobs.batches import service as batches

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["batches"])


class BatchBody(RequestBody):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


@router.post("/batches", responses=ok(Batch))
def create_batch(body: BatchBody, runtime: Runtime, session: DbSession, owner: Owner,
                 background: BackgroundTasks) -> Response:
    request = batches.BatchCreate(input_file_id=body.input_file_id, endpoint=body.endpoint,
                                  completion_window=body.completion_window, metadata=body.metadata)
    view = batches.create_batch(session, request, owner=owner, limits=runtime.limits,
                                embeddings_missing=runtime.resources_for.embeddings_missing())
    background.add_task(runtime.wake)  # after the commit: the executor finds the job
    return JSONBytes(view)


@router.get("/batches", responses=ok(BatchList))
def list_batches(
    session: DbSession,
    owner: Owner,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=batches.MAX_PAGE)] = 20,
) -> Response:
    return JSONBytes(batches.list_batch_views(session, owner=owner, after=after, limit=limit))


@router.get("/batches/{batch_id}", responses=ok(Batch))
def get_batch(batch_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(batches.describe_batch(session, batch_id, owner))


@router.post("/batches/{batch_id}/cancel", responses=ok(Batch))
def cancel_batch(batch_id: str, runtime: Runtime, session: DbSession, owner: Owner,
                 background: BackgroundTasks) -> Response:
    view = batches.cancel_batch(session, batch_id, owner)
    background.add_task(runtime.wake)
    return JSONBytes(view)
