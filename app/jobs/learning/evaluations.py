"""Evaluations: score a pipeline (its active parameters, or a given version) on a dataset with a loss or metric.

``POST /v1/evaluations`` queues one; a runner (the server's, or a Celery worker for scheduled runs) claims it,
runs ``evaluate()`` over the examples in chunks (so progress shows) and stores the mean score, each example's
score and feedback, and the errors of examples that failed (they count as 0).

Scheduled evaluations: a schedule holds a cron expression; :func:`fire_due_schedules` (called by a Celery beat
periodic task) turns each due fire time into one queued evaluation. The unique (schedule, fire time) constraint
makes firing idempotent: two firers, or one that retries, produce one evaluation per fire time. Fire times that
were missed while nothing fired (beat down) are skipped: a schedule fires its oldest due time, then moves to its
next time after now. ``GET .../runs`` is the time series, each run flagged ``regressed`` when its score is below
the previous scored run's by more than the schedule's margin.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repository, session_scope, to_unix, utcnow
from app.db.optimization_models import RUN_TERMINAL, Evaluation, EvaluationSchedule, RunStatus
from app.db.repository import learning as repo
from app.db.repository import runs
from app.jobs.encoding import storable, to_jsonable
from app.jobs.errors import InvalidJobInput, JobConflict, JobNotFound
from app.jobs.ids import new_evaluation_id, new_schedule_id
from app.jobs.learning.common import (
    SupervisedRun,
    check_examples_fit,
    check_limit,
    endpoints_for,
    load_examples,
    module_for,
    page,
    pipeline_aliases,
    registered_pipeline,
    stored_dataset,
)
from app.jobs.learning.cron import CronError, parse_cron
from app.jobs.learning.specs import build_loss, loss_spec_of
from app.jobs.submission import Limits
from app.pipeline.optimization import evaluate

log = logging.getLogger(__name__)

CHUNK = 32  # examples evaluated concurrently between two progress updates
#: an example's stored output is cut to this many characters of JSON: a run's details stay one modest row
MAX_OUTPUT_CHARS = 16_000


@dataclass
class EvaluationRequest:
    """The body of ``POST /v1/evaluations`` (and, with ``cron`` and ``margin``, of a schedule)."""

    pipeline: str
    dataset: Any
    loss: dict[str, Any] | str | None = None
    metric: str | dict[str, Any] | None = None
    version: int | None = None  # a stored parameter version; default: the active parameters at run time
    max_concurrent: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _checked(session: Session, request: EvaluationRequest, owner: str, limits: Limits) -> tuple[Any, dict[str, Any], int]:
    """Check the request as a run would use it; returns the pipeline row, the stored request and its size."""
    pipeline = registered_pipeline(session, request.pipeline, owner=owner)
    examples = load_examples(session, request.dataset, owner=owner, limits=limits)
    state = None
    if request.version is not None:
        row = repo.get_parameter_version(session, pipeline_id=pipeline.id, version=request.version)
        if row is None:
            raise InvalidJobInput(f"pipeline {request.pipeline!r} has no parameter version {request.version}",
                                  param="version", code="version_not_found")
        state = dict(row.state)
    check_examples_fit(module_for(pipeline, state), examples, request.pipeline)
    spec = loss_spec_of(request.loss, request.metric)
    build_loss(spec)  # refuses human feedback: nobody answers a scheduled run
    stored = {"dataset": stored_dataset(request.dataset), "loss": spec, "version": request.version,
              "max_concurrent": request.max_concurrent, "metadata": request.metadata}
    return pipeline, storable(stored), len(examples)


def submit_evaluation(session: Session, request: EvaluationRequest, *, owner: str = "anonymous",
                      limits: Limits | None = None) -> Evaluation:
    pipeline, stored, count = _checked(session, request, owner, limits or Limits())
    evaluation_id = new_evaluation_id()
    repo.create_evaluation(session, evaluation_id=evaluation_id, pipeline_id=pipeline.id,
                           pipeline_name=request.pipeline, owner=owner, request=stored, total_examples=count)
    return load_evaluation(session, evaluation_id)


def load_evaluation(session: Session, evaluation_id: str, owner: str | None = None) -> Evaluation:
    row = runs.get_run(session, Evaluation, run_id=evaluation_id, owner=owner)
    if row is None:
        raise JobNotFound(f"no evaluation {evaluation_id!r}: list your evaluations with GET /v1/evaluations",
                          param="evaluation_id", code="evaluation_not_found")
    return row


def evaluation_view(row: Evaluation, *, details: bool = False) -> dict[str, Any]:
    request = row.request or {}
    view: dict[str, Any] = {
        "id": row.id,
        "object": "evaluation",
        "pipeline": row.pipeline_name,
        "status": row.status,
        "loss": request.get("loss"),
        "metadata": request.get("metadata") or {},
        "parameter_version": row.parameter_version,
        "dataset": dataset_view(row),
        "schedule_id": row.schedule_id,
        "fire_time": to_unix(row.fire_time),
        "progress": {"completed_examples": row.completed_examples, "total_examples": row.total_examples},
        "score": row.score,
        "error": row.error,
        "created_at": to_unix(row.created_at),
        "started_at": to_unix(row.started_at),
        "finished_at": to_unix(row.finished_at),
    }
    if details:
        view["scores"] = row.scores
        view["details"] = row.details
    return view


def dataset_view(row: Evaluation) -> dict[str, Any]:
    """Where the evaluation's examples come from: ``{"source": "inline" | "file" | "registered", "file_id",
    "name", "examples"}`` (the count: the inline list's length, else the examples the run found)."""
    dataset = (row.request or {}).get("dataset")
    view: dict[str, Any] = {"source": "inline", "file_id": None, "name": None, "examples": row.total_examples}
    if isinstance(dataset, list):
        view["examples"] = len(dataset)
    elif isinstance(dataset, dict) and isinstance(dataset.get("file_id"), str):
        view.update(source="file", file_id=dataset["file_id"])
    elif isinstance(dataset, dict) and isinstance(dataset.get("name"), str):
        view.update(source="registered", name=dataset["name"])
    return view


def stored_output(value: Any) -> Any:
    """An example's output as its evaluation keeps it: plain JSON, or, past MAX_OUTPUT_CHARS characters, the
    start of its JSON text marked as cut."""
    output = to_jsonable(value)
    text = json.dumps(output, ensure_ascii=False, default=str)
    if len(text) <= MAX_OUTPUT_CHARS:
        return output
    return f"{text[:MAX_OUTPUT_CHARS]}... [cut: {len(text)} characters]"


def describe_evaluation(session: Session, evaluation_id: str, owner: str | None = None) -> dict[str, Any]:
    return evaluation_view(load_evaluation(session, evaluation_id, owner), details=True)


def list_evaluation_views(session: Session, *, owner: str | None, after: str | None = None,
                          limit: int = 20) -> dict[str, Any]:
    check_limit(limit)
    rows = runs.list_runs(session, Evaluation, owner=owner, after=after, limit=limit + 1)
    return page(rows, limit, evaluation_view)


def cancel_evaluation(session: Session, evaluation_id: str, owner: str | None = None) -> dict[str, Any]:
    row = load_evaluation(session, evaluation_id, owner)
    if row.status in RUN_TERMINAL:
        raise JobConflict(f"evaluation {evaluation_id} is already {row.status}; there is nothing to cancel",
                          param="evaluation_id", code="evaluation_finished")
    if row.status == RunStatus.QUEUED:
        runs.finish_run(session, Evaluation, run_id=row.id, status=RunStatus.CANCELLED)
    else:
        runs.request_cancel(session, Evaluation, run_id=row.id)
    return describe_evaluation(session, evaluation_id, owner)


# -- schedules --------------------------------------------------------------------------------------------------
def create_schedule(session: Session, request: EvaluationRequest, *, cron: str, margin: float = 0.0,
                    owner: str = "anonymous", limits: Limits | None = None,
                    now: datetime | None = None) -> EvaluationSchedule:
    try:
        parsed = parse_cron(cron)
    except CronError as exc:
        raise InvalidJobInput(str(exc), param="cron", code="invalid_cron") from None
    if not isinstance(margin, int | float) or isinstance(margin, bool) or margin < 0:
        raise InvalidJobInput("margin must be a number >= 0 (a drop of the score by more than it is a regression)",
                              param="margin")
    pipeline, stored, _ = _checked(session, request, owner, limits or Limits())
    return repo.create_schedule(
        session, schedule_id=new_schedule_id(), pipeline_id=pipeline.id, pipeline_name=request.pipeline,
        owner=owner, request=stored, cron=parsed.expression, margin=float(margin),
        next_fire_at=parsed.next_after(now or utcnow()),
    )


def load_schedule(session: Session, schedule_id: str, owner: str | None = None) -> EvaluationSchedule:
    row = repo.get_schedule(session, schedule_id=schedule_id, owner=owner)
    if row is None:
        raise JobNotFound(f"no evaluation schedule {schedule_id!r}: list them with GET /v1/evaluations/schedules",
                          param="schedule_id", code="schedule_not_found")
    return row


def schedule_view(row: EvaluationSchedule) -> dict[str, Any]:
    request = row.request or {}
    return {
        "id": row.id,
        "object": "evaluation_schedule",
        "pipeline": row.pipeline_name,
        "cron": row.cron,
        "margin": row.margin,
        "enabled": row.enabled,
        "loss": request.get("loss"),
        "metadata": request.get("metadata") or {},
        "next_fire_at": to_unix(row.next_fire_at),
        "last_fire_at": to_unix(row.last_fire_at),
        "created_at": to_unix(row.created_at),
    }


def list_schedule_views(session: Session, *, owner: str | None) -> dict[str, Any]:
    return {"object": "list", "data": [schedule_view(row) for row in repo.list_schedules(session, owner=owner)]}


def set_schedule_enabled(session: Session, schedule_id: str, enabled: bool, *, owner: str | None = None,
                         now: datetime | None = None) -> dict[str, Any]:
    """Pause or resume a schedule; resuming starts from the next fire time after now (no catch-up)."""
    row = load_schedule(session, schedule_id, owner)
    next_fire = parse_cron(row.cron).next_after(now or utcnow()) if enabled else row.next_fire_at
    repo.set_schedule_enabled(session, schedule_id=row.id, enabled=enabled, next_fire_at=next_fire)
    return schedule_view(load_schedule(session, schedule_id, owner))


def schedule_runs(session: Session, schedule_id: str, *, owner: str | None = None) -> dict[str, Any]:
    """The schedule's runs in fire-time order; ``regressed`` compares each score with the previous scored run:
    true when it dropped by more than the margin, null while a run has no score (yet)."""
    schedule = load_schedule(session, schedule_id, owner)
    rows = repo.schedule_runs(session, schedule_id=schedule.id)
    data = []
    previous: float | None = None
    for row in rows:
        view = evaluation_view(row)
        regressed: bool | None = None
        if row.score is not None:
            regressed = previous is not None and previous - row.score > schedule.margin + 1e-12
            view["previous_score"] = previous
            previous = row.score
        else:
            view["previous_score"] = previous
        view["regressed"] = regressed
        data.append(view)
    return {"object": "list", "schedule_id": schedule.id, "margin": schedule.margin, "data": data,
            "regressions": sum(1 for v in data if v["regressed"])}


def fire_due_schedules(session: Session, *, now: datetime | None = None) -> list[str]:
    """Queue one evaluation per due schedule (its oldest due fire time) and move each schedule on; returns the
    ids of the evaluations this call created (none for a fire time that already has one)."""
    now = now or utcnow()
    created: list[str] = []
    for schedule in repo.due_schedules(session, now=now):
        fire_time = schedule.next_fire_at
        try:
            cron = parse_cron(schedule.cron)
        except CronError as exc:  # stored before a parser change made it invalid: stop it, loudly
            log.error("evaluation schedule %s has an invalid cron (%s); disabling it", schedule.id, exc)
            repo.set_schedule_enabled(session, schedule_id=schedule.id, enabled=False,
                                      next_fire_at=schedule.next_fire_at)
            continue
        evaluation_id = new_evaluation_id()
        dataset = (schedule.request or {}).get("dataset")
        total = len(dataset) if isinstance(dataset, list) else 0
        with session.begin_nested():
            if repo.create_evaluation(
                session, evaluation_id=evaluation_id, pipeline_id=schedule.pipeline_id,
                pipeline_name=schedule.pipeline_name, owner=schedule.owner, request=dict(schedule.request),
                total_examples=total, schedule_id=schedule.id, fire_time=fire_time,
            ):
                created.append(evaluation_id)
        repo.advance_schedule(session, schedule_id=schedule.id, fired_at=fire_time,
                              next_fire_at=cron.next_after(max(now, _aware(fire_time))))
    return created


def _aware(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes: they are UTC
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


# -- running ----------------------------------------------------------------------------------------------------
class EvaluationRun(SupervisedRun):
    """One claimed evaluation, run in this process (the server's executor or a Celery worker)."""

    kind = "evaluation"

    def __init__(self, evaluation_id: str, sessions: sessionmaker[Session], *,
                 resources_for: Callable[[list[str]], Any], chunk: int = CHUNK) -> None:
        self.id = evaluation_id
        self.sessions = sessions
        self.resources_for = resources_for
        self.chunk = chunk

    async def _run(self) -> None:
        setup = await asyncio.to_thread(self._setup)
        if setup is None:
            return
        module, examples, request = setup
        loss_built = build_loss(request["loss"])
        resources = endpoints_for(self.resources_for, pipeline_aliases(module) + loss_built.aliases)
        scores: list[float | None] = []
        feedback: list[str | None] = []
        outputs: list[Any] = []
        errors: dict[str, str] = {}
        for start in range(0, len(examples), self.chunk):
            result = await evaluate(module, examples[start:start + self.chunk], loss_built.loss,
                                    resources=resources, max_concurrent=request.get("max_concurrent"))
            scores.extend(result.scores)
            feedback.extend(f.content if f is not None else None for f in result.feedback)
            outputs.extend(stored_output(value) for value in result.outputs)
            errors.update({str(start + i): message for i, message in result.errors.items()})
            await asyncio.to_thread(self._progress, start + len(result.scores))
        scored = any(s is not None for s in scores)
        counted = [0.0 if str(i) in errors else s for i, s in enumerate(scores)]
        known = [s for s in counted if s is not None]
        score = sum(known) / len(known) if scored and known else None
        await asyncio.to_thread(self._finish, RunStatus.COMPLETED, {
            "score": score, "scores": scores,
            "details": storable({"feedback": feedback, "errors": errors, "failures": len(errors),
                                 "outputs": outputs}),
        })

    # -- database steps (worker threads) ----------------------------------------------------------------------
    def _status(self) -> str | None:
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Evaluation, run_id=self.id)
            return row.status if row is not None else None

    def _setup(self) -> tuple[Any, list[Any], dict[str, Any]] | None:
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Evaluation, run_id=self.id)
            if row is None:
                return None
            pipeline = repository.get_pipeline(session, pipeline_id=row.pipeline_id)
            assert pipeline is not None
            request = dict(row.request)
            examples = load_examples(session, request["dataset"], owner=row.owner,
                                     limits=Limits(max_items=10**9, max_bytes=10**12))
            version = request.get("version")
            if version is not None:
                stored = repo.get_parameter_version(session, pipeline_id=pipeline.id, version=version)
                if stored is None:
                    raise LookupError(f"parameter version {version} of {pipeline.name} no longer exists")
                state: dict[str, Any] | None = dict(stored.state)
            else:
                version, state = pipeline.parameter_version or None, None
            module = module_for(pipeline, state)
            runs.set_progress(session, Evaluation, run_id=self.id, parameter_version=version,
                              total_examples=len(examples), completed_examples=0)
            return module, examples, request

    def _progress(self, done: int) -> None:
        with session_scope(self.sessions) as session:
            runs.set_progress(session, Evaluation, run_id=self.id, completed_examples=done)

    def _finish(self, status: RunStatus, values: dict[str, Any]) -> None:
        with session_scope(self.sessions) as session:
            runs.finish_run(session, Evaluation, run_id=self.id, status=status, **values)
