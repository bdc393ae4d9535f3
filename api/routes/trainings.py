"""Training routes: ``/v1/trainings``, a pipeline's parameter versions (list, diff, activate) and human feedback
(``/v1/feedback``). Thin: parse, authorise, call ``app.jobs``, shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import AliasChoices, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.deps import get_owner, require_api_key
from api.params import RequestBody, VersionPath, version_query
from api.responses import JSONBytes
from app.jobs.learning import feedback, parameters, training
from app.jobs.learning.common import MAX_PAGE
from app.jobs.learning.runtime import LearningRuntime

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["training"])


async def learning_runtime(request: Request) -> LearningRuntime:
    runtime: LearningRuntime = request.app.state.learning
    await runtime.ensure_started()
    return runtime


Runtime = Annotated[LearningRuntime, Depends(learning_runtime)]
Owner = Annotated[str, Depends(get_owner)]


class TrainingCreate(RequestBody):
    """The body of ``POST /v1/trainings``."""

    model_config = ConfigDict(extra="forbid")
    data_lists = frozenset({"dataset", "eval_dataset"})

    pipeline: str = Field(min_length=1)
    dataset: list[Any] | str | dict[str, Any] = Field(validation_alias=AliasChoices("dataset", "dataset_file_id"))
    loss: dict[str, Any] | str | None = None
    metric: str | dict[str, Any] | None = None
    optimizer: dict[str, Any] | str | None = None
    epochs: int = Field(default=1, ge=1, le=training.MAX_EPOCHS)
    batch_size: int = Field(default=4, ge=1, le=training.MAX_BATCH)
    seed: int | None = None
    shuffle: bool = True
    eval_dataset: list[Any] | str | dict[str, Any] | None = None
    activate: bool = True
    max_concurrent: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)


class FeedbackAnswer(RequestBody):
    """An answer to a human feedback request: free text, and per kind a rubric score, a choice or a ranking."""

    model_config = ConfigDict(extra="forbid")

    content: str = ""
    score: float | None = None
    choice: str | None = None
    ranking: list[int] | None = None


async def in_session(runtime: LearningRuntime, work: Any) -> Any:
    def call() -> Any:
        with runtime.session() as session:
            return work(session)

    return await run_in_threadpool(call)


@router.post("/trainings", status_code=201)
async def create_training(body: TrainingCreate, runtime: Runtime, owner: Owner) -> Response:
    request = training.TrainingRequest(**body.model_dump())

    def work(session: Any) -> dict[str, Any]:
        row = training.submit_training(session, request, owner=owner, limits=runtime.limits)
        return training.training_view(row, [])

    view = await in_session(runtime, work)
    runtime.wake()
    return JSONBytes(view, status_code=201, headers={"Location": f"/v1/trainings/{view['id']}"})


@router.get("/trainings")
async def list_trainings(
    runtime: Runtime,
    owner: Owner,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
) -> Response:
    return JSONBytes(await in_session(
        runtime, lambda s: training.list_training_views(s, owner=owner, after=after, limit=limit)))


@router.get("/trainings/{training_id}")
async def get_training(training_id: str, runtime: Runtime, owner: Owner) -> Response:
    return JSONBytes(await in_session(runtime, lambda s: training.describe_training(s, training_id, owner)))


@router.post("/trainings/{training_id}/cancel")
async def cancel_training(training_id: str, runtime: Runtime, owner: Owner) -> Response:
    view = await in_session(runtime, lambda s: training.cancel_training(s, training_id, owner))
    runtime.wake()
    return JSONBytes(view)


# -- parameter versions -----------------------------------------------------------------------------------------
@router.get("/pipelines/{name}/parameters/versions")
async def list_versions(name: str, runtime: Runtime, owner: Owner) -> Response:
    return JSONBytes(await in_session(runtime, lambda s: parameters.list_versions(s, name, owner=owner)))


@router.get("/pipelines/{name}/parameters/versions/diff")
async def diff_versions(
    name: str,
    runtime: Runtime,
    owner: Owner,
    old: Annotated[int, version_query("from", "The version to compare from")],
    new: Annotated[int, version_query("to", "The version to compare to")],
) -> Response:
    return JSONBytes(await in_session(runtime, lambda s: parameters.diff_versions(s, name, old, new, owner=owner)))


@router.get("/pipelines/{name}/parameters/versions/{version}")
async def get_version(name: str, version: VersionPath, runtime: Runtime, owner: Owner) -> Response:
    return JSONBytes(await in_session(runtime, lambda s: parameters.get_version(s, name, version, owner=owner)))


@router.post("/pipelines/{name}/parameters/versions/{version}/activate")
async def activate_version(name: str, version: VersionPath, runtime: Runtime, owner: Owner) -> Response:
    """Roll the pipeline's active parameters to a stored version: later jobs, evaluations and trainings of the
    pipeline use its values."""
    return JSONBytes(await in_session(runtime, lambda s: parameters.activate_version(s, name, version, owner=owner)))


# -- human feedback ---------------------------------------------------------------------------------------------
@router.get("/feedback/pending")
async def pending_feedback(
    runtime: Runtime,
    owner: Owner,
    training_id: Annotated[str | None, Query(description="Only the requests of this training")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> Response:
    return JSONBytes(await in_session(
        runtime, lambda s: feedback.pending_views(s, owner=owner, training_id=training_id, limit=limit)))


@router.post("/feedback/{request_id}")
async def answer_feedback(request_id: str, body: FeedbackAnswer, runtime: Runtime, owner: Owner) -> Response:
    answer = body.model_dump(exclude_none=True)
    return JSONBytes(await in_session(runtime, lambda s: feedback.answer_request(s, request_id, answer,
                                                                                   owner=owner)))
