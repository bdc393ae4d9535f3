"""Trainings, evaluations, their schedules and example comparisons, parameter versions and pipelines
(``app.jobs.learning``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.client.types.common import Page, RunStatus, Unix


# -- trainings --------------------------------------------------------------------------------------------------
class TrainingProgress(BaseModel):
    completed_steps: int
    total_steps: int


class TrainingStep(BaseModel):
    step: int
    epoch: int
    batch: int
    score: float | None = Field(description="The batch's mean score before this step's update")
    scores: list[Any]
    version: int | None = Field(description="The parameter version this step produced")
    updates: list[Any]
    errors: dict[str, Any]


class TrainingCandidate(BaseModel):
    """One candidate a selection-gated (gepa) training measured."""

    id: int
    parent: int | None = Field(description="The candidate it was proposed from (null for the seed)")
    step: int
    kind: Literal["seed", "instruction", "demos"]
    state: dict[str, Any] = Field(description="Its learnable values: instructions and demonstrations")
    changed: list[str] = Field(description="The parameters that differ from its parent")
    minibatch: list[int] = Field(description="Training example indices it was scored on")
    parent_minibatch_score: float | None
    minibatch_score: float | None
    parent_scores: list[float]
    scores: list[float]
    gain: float | None = Field(description="Mean paired gain over the parent on the minibatch")
    noise: float | None = Field(description="noise_z standard errors of that gain; accepted only above it")
    accepted: bool
    val_score: float | None
    val_scores: list[float] | None
    best: bool = Field(description="It became the best (active) candidate when validated")
    note: str


class Training(BaseModel):
    """A training run; ``steps`` (and ``candidates``) only in the single-training view."""

    id: str
    object: Literal["training"]
    pipeline: str
    status: RunStatus
    epochs: int | None
    validation_dataset: Any = None
    batch_size: int | None
    seed: int | None
    loss: Any
    optimizer: Any
    metadata: dict[str, Any]
    progress: TrainingProgress
    base_version: int | None
    final_version: int | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: Unix
    started_at: Unix | None
    finished_at: Unix | None
    steps: list[TrainingStep] | None = None
    candidates: list[TrainingCandidate] | None = None


class TrainingList(Page):
    data: list[Training]


# -- evaluations ------------------------------------------------------------------------------------------------
class EvaluationProgress(BaseModel):
    completed_examples: int
    total_examples: int


class DatasetRef(BaseModel):
    """Where an evaluation's examples come from."""

    source: Literal["inline", "file", "registered"]
    file_id: str | None
    name: str | None = Field(description="The registered dataset's name (source 'registered')")
    examples: int


class Evaluation(BaseModel):
    """An evaluation run; ``scores`` and ``details`` only in the single-evaluation view."""

    id: str
    object: Literal["evaluation"]
    pipeline: str
    status: RunStatus
    loss: Any
    metadata: dict[str, Any]
    parameter_version: int | None
    dataset: DatasetRef
    schedule_id: str | None
    fire_time: Unix | None
    progress: EvaluationProgress
    score: float | None
    error: dict[str, Any] | None
    created_at: Unix
    started_at: Unix | None
    finished_at: Unix | None
    scores: list[float | None] | None = None
    details: dict[str, Any] | None = Field(default=None, description="feedback, errors, failures and outputs "
                                                                     "per example")


class EvaluationList(Page):
    data: list[Evaluation]


class ExampleBaseline(BaseModel):
    output: Any
    score: float | None


class ExampleRow(BaseModel):
    index: int
    input: Any
    target: Any
    output: Any = Field(description="null before the run finished, where the example failed, or for runs "
                                    "stored before outputs were kept")
    score: float | None = Field(description="A failed example scores 0.0")
    feedback: str | None
    error: str | None
    baseline: ExampleBaseline | None = Field(description="The baseline's result for the same index")
    delta: float | None = Field(description="score minus the baseline's score")


class ComparisonSummary(BaseModel):
    count: int
    mean: float | None
    baseline_mean: float | None
    paired: int = Field(description="Examples with a score in both evaluations")
    improved: int
    regressed: int
    unchanged: int


class ExampleComparison(BaseModel):
    """An evaluation example by example, optionally beside a baseline evaluation."""

    object: Literal["list"]
    evaluation_id: str
    baseline_id: str | None
    summary: ComparisonSummary
    data: list[ExampleRow]
    total: int = Field(description="Examples that match the filters")
    has_more: bool


class Schedule(BaseModel):
    """A cron schedule of evaluations."""

    id: str
    object: Literal["evaluation_schedule"]
    pipeline: str
    cron: str
    margin: float
    enabled: bool
    loss: Any
    metadata: dict[str, Any]
    next_fire_at: Unix | None
    last_fire_at: Unix | None
    created_at: Unix


class ScheduleList(BaseModel):
    object: Literal["list"]
    data: list[Schedule]


class ScheduleRun(Evaluation):
    previous_score: float | None = Field(description="The score of the previous scored run")
    regressed: bool | None = Field(description="The score fell by more than the margin; null while unscored")


class ScheduleRuns(BaseModel):
    """A schedule's evaluations in fire-time order."""

    object: Literal["list"]
    schedule_id: str
    margin: float
    data: list[ScheduleRun]
    regressions: int


# -- parameter versions and pipelines ----------------------------------------------------------------------------
class ParameterVersion(BaseModel):
    object: Literal["parameter_version"]
    pipeline: str
    version: int
    active: bool
    state: dict[str, Any]
    score: float | None
    note: str | None
    source: str | None = Field(description="'initial' or 'training' for versions a training stored")
    training_id: str | None
    step: int | None
    batch_score: float | None
    updates: list[Any]
    created_at: Unix


class ParameterVersionList(BaseModel):
    object: Literal["list"]
    pipeline: str
    active_version: int | None
    data: list[ParameterVersion]


class ParameterChange(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str
    from_: Any = Field(alias="from")
    to: Any
    diff: str


class ParameterDiff(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    object: Literal["parameter_diff"]
    pipeline: str
    from_: int = Field(alias="from")
    to: int
    changes: list[ParameterChange]
    unchanged: list[str]


class PipelineInfo(BaseModel):
    object: Literal["pipeline"]
    name: str = Field(description="The registered name a request gives")
    active_version: int | None = Field(description="The caller's active parameter version (null before any)")
    versions: int = Field(description="How many parameter versions the caller has stored")


class PipelineList(BaseModel):
    object: Literal["list"]
    data: list[PipelineInfo]


# -- human feedback ---------------------------------------------------------------------------------------------
class FeedbackRequest(BaseModel):
    """A question a running training asks a person (``GET /v1/feedback/pending``); the keys of its kind
    (``outputs``, ``criteria``, ``rubric``, ``target``, ``context``, ``require_feedback``) come as extra fields."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["feedback_request"]
    training_id: str | None
    status: str
    kind: str
    answer: dict[str, Any] | None
    created_at: Unix | None
    answered_at: Unix | None


class FeedbackList(BaseModel):
    object: Literal["list"]
    data: list[FeedbackRequest]
