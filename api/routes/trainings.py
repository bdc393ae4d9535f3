"""Training routes: ``/v1/trainings``, a pipeline's parameter versions (list, diff, activate) and human feedback
(``/v1/feedback``). Thin: parse, authorise, call ``app.jobs``, shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, Query, Response
from pydantic import AliasChoices, ConfigDict, Field

from api.deps import DbSession, Learning, Owner, learning_runtime, require_api_key
from api.params import RequestBody, VersionPath, version_query
from api.responses import JSONBytes
from api.schemas import (
    ParameterDiff,
    ParameterVersion,
    ParameterVersionList,
    PipelineList,
    Training,
    TrainingList,
    created,
    ok,
)
from app.jobs.learning import feedback, parameters, training
from app.jobs.learning.common import MAX_PAGE

# every route starts the learning executor (it resumes the runs a previous server left)
router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(learning_runtime)],
                   tags=["training"])


class TrainingCreate(RequestBody):
    """The body of ``POST /v1/trainings``."""

    model_config = ConfigDict(extra="forbid")
    data_lists = frozenset({"dataset", "eval_dataset", "validation_dataset"})

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
    validation_dataset: list[Any] | str | dict[str, Any] | None = None
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


@router.post("/trainings", status_code=201, responses=created(Training))
def create_training(body: TrainingCreate, runtime: Learning, session: DbSession, owner: Owner,
                    background: BackgroundTasks) -> Response:
    row = training.submit_training(session, training.TrainingRequest(**body.model_dump()), owner=owner,
                                   limits=runtime.limits)
    view = training.training_view(row, [])
    background.add_task(runtime.wake)  # after the commit: the executor finds the run
    return JSONBytes(view, status_code=201, headers={"Location": f"/v1/trainings/{view['id']}"})


@router.get("/trainings", responses=ok(TrainingList))
def list_trainings(
    session: DbSession,
    owner: Owner,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
) -> Response:
    return JSONBytes(training.list_training_views(session, owner=owner, after=after, limit=limit))


@router.get("/trainings/{training_id}", responses=ok(Training))
def get_training(training_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(training.describe_training(session, training_id, owner))


@router.post("/trainings/{training_id}/cancel", responses=ok(Training))
def cancel_training(training_id: str, runtime: Learning, session: DbSession, owner: Owner,
                    background: BackgroundTasks) -> Response:
    view = training.cancel_training(session, training_id, owner)
    background.add_task(runtime.wake)
    return JSONBytes(view)


# -- pipelines and their parameter versions ---------------------------------------------------------------------
@router.get("/pipelines", responses=ok(PipelineList))
def list_pipelines(session: DbSession, owner: Owner) -> Response:
    """The pipelines this server runs, each with the caller's active parameter version and how many it has."""
    return JSONBytes(parameters.list_pipelines(session, owner=owner))


@router.get("/pipelines/{name}/parameters/versions", responses=ok(ParameterVersionList))
def list_versions(name: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(parameters.list_versions(session, name, owner=owner))


@router.get("/pipelines/{name}/parameters/versions/diff", responses=ok(ParameterDiff))
def diff_versions(
    name: str,
    session: DbSession,
    owner: Owner,
    old: Annotated[int, version_query("from", "The version to compare from")],
    new: Annotated[int, version_query("to", "The version to compare to")],
) -> Response:
    return JSONBytes(parameters.diff_versions(session, name, old, new, owner=owner))


@router.get("/pipelines/{name}/parameters/versions/{version}", responses=ok(ParameterVersion))
def get_version(name: str, version: VersionPath, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(parameters.get_version(session, name, version, owner=owner))


@router.post("/pipelines/{name}/parameters/versions/{version}/activate", responses=ok(ParameterVersion))
def activate_version(name: str, version: VersionPath, session: DbSession, owner: Owner) -> Response:
    """Roll the tenant's active parameters of the pipeline to a stored version: its later jobs, evaluations and
    trainings of the pipeline use its values."""
    return JSONBytes(parameters.activate_version(session, name, version, owner=owner))


# -- human feedback ---------------------------------------------------------------------------------------------
@router.get("/feedback/pending")
def pending_feedback(
    session: DbSession,
    owner: Owner,
    training_id: Annotated[str | None, Query(description="Only the requests of this training")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> Response:
    return JSONBytes(feedback.pending_views(session, owner=owner, training_id=training_id, limit=limit))


@router.post("/feedback/{request_id}")
def answer_feedback(request_id: str, body: FeedbackAnswer, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(feedback.answer_request(session, request_id, body.model_dump(exclude_none=True), owner=owner))
