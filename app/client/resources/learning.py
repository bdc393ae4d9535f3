"""Trainings, evaluations and their schedules, pipelines and their parameter versions, human feedback.

A dataset is a list of examples (``{"input": ..., "target": ...}``), JSONL text, or the id of an uploaded file;
a loss is a spec (``{"type": "verifier", "check": "exact"}``) or a registered name; ``metric`` names a verifier
check instead (``exact``, ``contains``...)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from app.client._core import body, path, query
from app.client._sync import SyncResource, sync_method
from app.client.resources.base import AsyncResource, wait_terminal
from app.client.types import (
    Evaluation,
    EvaluationList,
    ExampleComparison,
    FeedbackList,
    FeedbackRequest,
    ParameterDiff,
    ParameterVersion,
    ParameterVersionList,
    PipelineList,
    Schedule,
    ScheduleList,
    ScheduleRuns,
    Training,
    TrainingList,
)

Dataset = Iterable[Any] | str | Mapping[str, Any]
Spec = Mapping[str, Any] | str


class AsyncTrainings(AsyncResource):
    async def create(
        self,
        pipeline: str,
        dataset: Dataset,
        *,
        loss: Spec | None = None,
        metric: Spec | None = None,
        optimizer: Spec | None = None,
        epochs: int | None = None,
        batch_size: int | None = None,
        seed: int | None = None,
        shuffle: bool | None = None,
        eval_dataset: Dataset | None = None,
        validation_dataset: Dataset | None = None,
        activate: bool | None = None,
        max_concurrent: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Training:
        """Train the pipeline's learnable parameters on ``dataset``; each optimizer step stores a parameter
        version, and the final one becomes active unless ``activate=False``."""
        payload = body(pipeline=pipeline, dataset=_data(dataset), loss=_data(loss), metric=_data(metric),
                       optimizer=_data(optimizer), epochs=epochs, batch_size=batch_size, seed=seed, shuffle=shuffle,
                       eval_dataset=_data(eval_dataset), validation_dataset=_data(validation_dataset),
                       activate=activate, max_concurrent=max_concurrent, metadata=_data(metadata))
        return await self._core.call(Training, "POST", "/v1/trainings", json=payload)

    async def get(self, training_id: str) -> Training:
        """The training with its ``steps`` (and a gepa training's ``candidates``)."""
        return await self._core.call(Training, "GET", path("/v1/trainings/{}", training_id))

    async def list(self, *, after: str | None = None, limit: int | None = None) -> TrainingList:
        return await self._core.call(TrainingList, "GET", "/v1/trainings", params=query(after=after, limit=limit))

    async def cancel(self, training_id: str) -> Training:
        return await self._core.call(Training, "POST", path("/v1/trainings/{}/cancel", training_id))

    async def wait(self, training_id: str, *, poll_interval: float = 0.5, timeout: float | None = None) -> Training:
        """The training once it is completed, failed or cancelled (TimeoutError after ``timeout`` seconds)."""
        return await wait_terminal(lambda: self.get(training_id), poll_interval, timeout)


class Trainings(SyncResource[AsyncTrainings]):
    create = sync_method(AsyncTrainings.create)
    get = sync_method(AsyncTrainings.get)
    list = sync_method(AsyncTrainings.list)
    cancel = sync_method(AsyncTrainings.cancel)
    wait = sync_method(AsyncTrainings.wait)


class AsyncEvaluations(AsyncResource):
    async def create(
        self,
        pipeline: str,
        dataset: Dataset,
        *,
        loss: Spec | None = None,
        metric: Spec | None = None,
        version: int | None = None,
        max_concurrent: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Evaluation:
        """Score the pipeline (its active parameters, or parameter ``version``) on ``dataset``."""
        payload = body(pipeline=pipeline, dataset=_data(dataset), loss=_data(loss), metric=_data(metric),
                       version=version, max_concurrent=max_concurrent, metadata=_data(metadata))
        return await self._core.call(Evaluation, "POST", "/v1/evaluations", json=payload)

    async def get(self, evaluation_id: str) -> Evaluation:
        """The evaluation with its per-example ``scores`` and ``details``."""
        return await self._core.call(Evaluation, "GET", path("/v1/evaluations/{}", evaluation_id))

    async def list(self, *, after: str | None = None, limit: int | None = None) -> EvaluationList:
        return await self._core.call(EvaluationList, "GET", "/v1/evaluations",
                                     params=query(after=after, limit=limit))

    async def cancel(self, evaluation_id: str) -> Evaluation:
        return await self._core.call(Evaluation, "POST", path("/v1/evaluations/{}/cancel", evaluation_id))

    async def wait(self, evaluation_id: str, *, poll_interval: float = 0.5,
                   timeout: float | None = None) -> Evaluation:
        """The evaluation once it is completed, failed or cancelled (TimeoutError after ``timeout`` seconds)."""
        return await wait_terminal(lambda: self.get(evaluation_id), poll_interval, timeout)

    async def examples(
        self,
        evaluation_id: str,
        *,
        baseline: str | None = None,
        order: str | None = None,
        below: float | None = None,
        offset: int | None = None,
        limit: int | None = None,
    ) -> ExampleComparison:
        """The evaluation example by example, each beside its result in the ``baseline`` evaluation if given;
        ``order="regressions"`` puts the largest drops first."""
        params = query(baseline=baseline, order=order, below=below, offset=offset, limit=limit)
        return await self._core.call(ExampleComparison, "GET", path("/v1/evaluations/{}/examples", evaluation_id),
                                     params=params)


class Evaluations(SyncResource[AsyncEvaluations]):
    create = sync_method(AsyncEvaluations.create)
    get = sync_method(AsyncEvaluations.get)
    list = sync_method(AsyncEvaluations.list)
    cancel = sync_method(AsyncEvaluations.cancel)
    wait = sync_method(AsyncEvaluations.wait)
    examples = sync_method(AsyncEvaluations.examples)


class AsyncSchedules(AsyncResource):
    async def create(
        self,
        pipeline: str,
        dataset: Dataset,
        *,
        cron: str,
        margin: float | None = None,
        loss: Spec | None = None,
        metric: Spec | None = None,
        version: int | None = None,
        max_concurrent: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Schedule:
        """Evaluate the pipeline on ``dataset`` at each time of the five-field ``cron`` (UTC); a run whose score
        falls by more than ``margin`` below the previous run's is flagged ``regressed``."""
        payload = body(pipeline=pipeline, dataset=_data(dataset), cron=cron, margin=margin, loss=_data(loss),
                       metric=_data(metric), version=version, max_concurrent=max_concurrent,
                       metadata=_data(metadata))
        return await self._core.call(Schedule, "POST", "/v1/evaluations/schedules", json=payload)

    async def get(self, schedule_id: str) -> Schedule:
        return await self._core.call(Schedule, "GET", path("/v1/evaluations/schedules/{}", schedule_id))

    async def list(self) -> ScheduleList:
        return await self._core.call(ScheduleList, "GET", "/v1/evaluations/schedules")

    async def runs(self, schedule_id: str) -> ScheduleRuns:
        """The schedule's evaluations in fire-time order, each with ``regressed``."""
        return await self._core.call(ScheduleRuns, "GET", path("/v1/evaluations/schedules/{}/runs", schedule_id))

    async def pause(self, schedule_id: str) -> Schedule:
        return await self._core.call(Schedule, "POST", path("/v1/evaluations/schedules/{}/pause", schedule_id))

    async def resume(self, schedule_id: str) -> Schedule:
        return await self._core.call(Schedule, "POST", path("/v1/evaluations/schedules/{}/resume", schedule_id))


class Schedules(SyncResource[AsyncSchedules]):
    create = sync_method(AsyncSchedules.create)
    get = sync_method(AsyncSchedules.get)
    list = sync_method(AsyncSchedules.list)
    runs = sync_method(AsyncSchedules.runs)
    pause = sync_method(AsyncSchedules.pause)
    resume = sync_method(AsyncSchedules.resume)


class AsyncPipelines(AsyncResource):
    """The pipelines the server runs and the caller's parameter versions of each."""

    async def list(self) -> PipelineList:
        """Each pipeline with the caller's active parameter version and how many versions it has."""
        return await self._core.call(PipelineList, "GET", "/v1/pipelines")

    async def versions(self, pipeline: str) -> ParameterVersionList:
        return await self._core.call(ParameterVersionList, "GET",
                                     path("/v1/pipelines/{}/parameters/versions", pipeline))

    async def version(self, pipeline: str, version: int) -> ParameterVersion:
        return await self._core.call(ParameterVersion, "GET",
                                     path("/v1/pipelines/{}/parameters/versions/{}", pipeline, version))

    async def diff(self, pipeline: str, old: int, new: int) -> ParameterDiff:
        """What changed between two parameter versions (``changes``, each with a unified ``diff``)."""
        return await self._core.call(ParameterDiff, "GET", path("/v1/pipelines/{}/parameters/versions/diff", pipeline),
                                     params={"from": old, "to": new})

    async def activate(self, pipeline: str, version: int) -> ParameterVersion:
        """Make ``version`` the caller's active parameters of the pipeline (a rollback, or a roll forward)."""
        return await self._core.call(ParameterVersion, "POST",
                                     path("/v1/pipelines/{}/parameters/versions/{}/activate", pipeline, version))


class Pipelines(SyncResource[AsyncPipelines]):
    list = sync_method(AsyncPipelines.list)
    versions = sync_method(AsyncPipelines.versions)
    version = sync_method(AsyncPipelines.version)
    diff = sync_method(AsyncPipelines.diff)
    activate = sync_method(AsyncPipelines.activate)


class AsyncFeedback(AsyncResource):
    """Human feedback a running training asks for."""

    async def pending(self, *, training_id: str | None = None, limit: int | None = None) -> FeedbackList:
        return await self._core.call(FeedbackList, "GET", "/v1/feedback/pending",
                                     params=query(training_id=training_id, limit=limit))

    async def answer(
        self,
        request_id: str,
        *,
        content: str | None = None,
        score: float | None = None,
        choice: str | None = None,
        ranking: Iterable[int] | None = None,
    ) -> FeedbackRequest:
        """Answer a request: free text, and per kind a rubric ``score``, a preference ``choice`` (A or B) or a
        ``ranking``."""
        payload = body(content=content, score=score, choice=choice, ranking=None if ranking is None else list(ranking))
        return await self._core.call(FeedbackRequest, "POST", path("/v1/feedback/{}", request_id), json=payload)


class Feedback(SyncResource[AsyncFeedback]):
    pending = sync_method(AsyncFeedback.pending)
    answer = sync_method(AsyncFeedback.answer)


def _data(value: Any) -> Any:
    """A dataset, spec or mapping as JSON: iterables become lists, mappings dicts."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return dict(value)
    return list(value)
