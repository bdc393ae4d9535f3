"""Evaluation routes: ``/v1/evaluations`` and ``/v1/evaluations/schedules`` (cron schedules run by Celery beat,
their runs as a time series with regression flags). Thin: parse, authorise, call ``app.jobs``, shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, Query, Response
from pydantic import AliasChoices, ConfigDict, Field

from api.deps import DbSession, Learning, Owner, learning_runtime, require_api_key
from api.params import DB_INT_MAX, RequestBody
from api.responses import JSONBytes
from api.schemas import (
    Evaluation,
    EvaluationList,
    ExampleComparison,
    Schedule,
    ScheduleList,
    ScheduleRuns,
    created,
    ok,
)
from app.jobs.learning import evaluations, examples
from app.jobs.learning.common import MAX_PAGE

# every route starts the learning executor (it resumes the runs a previous server left)
router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(learning_runtime)],
                   tags=["evaluations"])


class EvaluationCreate(RequestBody):
    """The body of ``POST /v1/evaluations``: a loss spec or a metric name."""

    model_config = ConfigDict(extra="forbid")
    data_lists = frozenset({"dataset"})

    pipeline: str = Field(min_length=1)
    dataset: list[Any] | str | dict[str, Any] = Field(validation_alias=AliasChoices("dataset", "dataset_file_id"))
    loss: dict[str, Any] | str | None = None
    metric: str | dict[str, Any] | None = None
    version: int | None = Field(default=None, ge=1, le=DB_INT_MAX)
    max_concurrent: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def to_request(self) -> evaluations.EvaluationRequest:
        return evaluations.EvaluationRequest(
            pipeline=self.pipeline, dataset=self.dataset, loss=self.loss, metric=self.metric, version=self.version,
            max_concurrent=self.max_concurrent, metadata=self.metadata,
        )


class ScheduleCreate(EvaluationCreate):
    """The body of ``POST /v1/evaluations/schedules``."""

    cron: str = Field(min_length=1, description="Five-field cron in UTC, e.g. '0 3 * * *'")
    margin: float = Field(default=0.0, ge=0, description="A score drop above this flags a run as regressed")


# the schedule routes come first: /evaluations/schedules is not an evaluation id
@router.post("/evaluations/schedules", status_code=201, responses=created(Schedule))
def create_schedule(body: ScheduleCreate, runtime: Learning, session: DbSession, owner: Owner) -> Response:
    row = evaluations.create_schedule(session, body.to_request(), cron=body.cron, margin=body.margin,
                                      owner=owner, limits=runtime.limits)
    view = evaluations.schedule_view(row)
    return JSONBytes(view, status_code=201, headers={"Location": f"/v1/evaluations/schedules/{view['id']}"})


@router.get("/evaluations/schedules", responses=ok(ScheduleList))
def list_schedules(session: DbSession, owner: Owner) -> Response:
    return JSONBytes(evaluations.list_schedule_views(session, owner=owner))


@router.get("/evaluations/schedules/{schedule_id}", responses=ok(Schedule))
def get_schedule(schedule_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(evaluations.schedule_view(evaluations.load_schedule(session, schedule_id, owner)))


@router.get("/evaluations/schedules/{schedule_id}/runs", responses=ok(ScheduleRuns))
def schedule_runs(schedule_id: str, session: DbSession, owner: Owner) -> Response:
    """The schedule's evaluations in fire-time order, each with ``regressed``: its score fell below the previous
    run's by more than the schedule's margin."""
    return JSONBytes(evaluations.schedule_runs(session, schedule_id, owner=owner))


@router.post("/evaluations/schedules/{schedule_id}/pause", responses=ok(Schedule))
def pause_schedule(schedule_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(evaluations.set_schedule_enabled(session, schedule_id, False, owner=owner))


@router.post("/evaluations/schedules/{schedule_id}/resume", responses=ok(Schedule))
def resume_schedule(schedule_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(evaluations.set_schedule_enabled(session, schedule_id, True, owner=owner))


@router.post("/evaluations", status_code=201, responses=created(Evaluation))
def create_evaluation(body: EvaluationCreate, runtime: Learning, session: DbSession, owner: Owner,
                      background: BackgroundTasks) -> Response:
    row = evaluations.submit_evaluation(session, body.to_request(), owner=owner, limits=runtime.limits)
    view = evaluations.evaluation_view(row)
    background.add_task(runtime.wake)  # after the commit: the executor finds the run
    return JSONBytes(view, status_code=201, headers={"Location": f"/v1/evaluations/{view['id']}"})


@router.get("/evaluations", responses=ok(EvaluationList))
def list_evaluations(
    session: DbSession,
    owner: Owner,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
) -> Response:
    return JSONBytes(evaluations.list_evaluation_views(session, owner=owner, after=after, limit=limit))


@router.get("/evaluations/{evaluation_id}", responses=ok(Evaluation))
def get_evaluation(evaluation_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(evaluations.describe_evaluation(session, evaluation_id, owner))


@router.get("/evaluations/{evaluation_id}/examples", responses=ok(ExampleComparison))
def evaluation_examples(
    evaluation_id: str,
    session: DbSession,
    owner: Owner,
    baseline: Annotated[str | None, Query(description="Another evaluation's id: each example beside its result "
                                                      "there (paired by index)")] = None,
    order: Annotated[str, Query(description="'index' (dataset order) or 'regressions' (largest score drop "
                                            "against the baseline first)")] = "index",
    below: Annotated[float | None, Query(description="Only examples scored below this")] = None,
    offset: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=examples.MAX_LIMIT)] = 50,
) -> Response:
    """The evaluation example by example: input, target, output, score, feedback and error, and with
    ``baseline`` that evaluation's output and score for the same example and the difference (``delta``)."""
    return JSONBytes(examples.compare_examples(session, evaluation_id, owner=owner, baseline=baseline, order=order,
                                               below=below, offset=offset, limit=limit))


@router.post("/evaluations/{evaluation_id}/cancel", responses=ok(Evaluation))
def cancel_evaluation(evaluation_id: str, runtime: Learning, session: DbSession, owner: Owner,
                      background: BackgroundTasks) -> Response:
    view = evaluations.cancel_evaluation(session, evaluation_id, owner)
    background.add_task(runtime.wake)
    return JSONBytes(view)
