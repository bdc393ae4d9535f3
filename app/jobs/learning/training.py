"""Training jobs: ``POST /v1/trainings`` runs ``train()`` on a registered pipeline in the background and stores,
per optimizer step, the parameter version it produced (the new state, and for each changed parameter its old
value, new value, the feedback that caused the change and the scores behind it).

Versions are appended as the training goes but not made active: at the end the final version becomes the
pipeline's active parameters (what later jobs load) unless the request says ``"activate": false``. A training
that fails leaves the active parameters alone; its step versions stay in the history, to activate by hand.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import ParameterVersion, repository, session_scope, to_unix
from app.db.optimization_models import RUN_TERMINAL, RunStatus, Training
from app.db.repository import learning as repo
from app.db.repository import runs
from app.jobs.encoding import storable, to_jsonable
from app.jobs.errors import InvalidJobInput, JobConflict, JobNotFound
from app.jobs.ids import new_training_id
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
    steps_of,
    stored_dataset,
)
from app.jobs.learning.feedback import database_source
from app.jobs.learning.selection import (
    best_changes,
    candidate_views,
    check_budget,
    estimated_steps,
    split_validation,
    step_values,
)
from app.jobs.learning.specs import OptimizerSpec, build_loss, loss_spec_of, parse_optimizer, require_scores
from app.jobs.submission import Limits
from app.pipeline.optimization import QueueFeedbackSource, SelectionStep, TrainingStep, train

log = logging.getLogger(__name__)

MAX_EPOCHS = 100
MAX_BATCH = 1000


@dataclass
class TrainingRequest:
    """The body of ``POST /v1/trainings``."""

    pipeline: str
    dataset: Any
    loss: dict[str, Any] | str | None = None
    metric: str | dict[str, Any] | None = None
    optimizer: dict[str, Any] | str | None = None
    epochs: int = 1
    batch_size: int = 4
    seed: int | None = None
    shuffle: bool = True
    eval_dataset: Any = None
    validation_dataset: Any = None  # what the gepa optimizer chooses on (default: a third of dataset held out)
    activate: bool = True
    max_concurrent: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def submit_training(session: Session, request: TrainingRequest, *, owner: str = "anonymous",
                    limits: Limits | None = None) -> Training:
    """Check everything a run needs (pipeline, dataset fits it, learnable parameters, loss, optimizer) and
    queue the training; nothing is written when a check fails."""
    limits = limits or Limits()
    if not 1 <= request.epochs <= MAX_EPOCHS:
        raise InvalidJobInput(f"epochs must be between 1 and {MAX_EPOCHS}, not {request.epochs}", param="epochs")
    if not 1 <= request.batch_size <= MAX_BATCH:
        raise InvalidJobInput(f"batch_size must be between 1 and {MAX_BATCH}, not {request.batch_size}",
                              param="batch_size")
    pipeline = registered_pipeline(session, request.pipeline, owner=owner)
    examples = load_examples(session, request.dataset, owner=owner, limits=limits)
    module = module_for(pipeline)
    check_examples_fit(module, examples, request.pipeline)
    if request.eval_dataset is not None:
        held_out = load_examples(session, request.eval_dataset, owner=owner, limits=limits, param="eval_dataset")
        check_examples_fit(module, held_out, request.pipeline, param="eval_dataset")
    learnable = [name for name, p in module.named_parameters() if p.requires_grad]
    if not learnable:
        raise InvalidJobInput(
            f"pipeline {request.pipeline!r} has no learnable parameter: give a prompt as Parameter(value, "
            "description=...) so that training has something to improve", param="pipeline",
        )
    loss_spec = loss_spec_of(request.loss, request.metric)
    build_loss(loss_spec, human=QueueFeedbackSource)  # checks the spec; the run builds its own
    optimizer = parse_optimizer(request.optimizer)
    total_steps = steps_of(len(examples), request.batch_size, request.epochs)
    if optimizer.selection:
        require_scores(loss_spec)
        total_steps = _selection_steps(session, request, examples, module, optimizer, owner, limits)
    elif request.validation_dataset is not None:
        raise InvalidJobInput("validation_dataset is what the gepa optimizer chooses on; the sfa and basic "
                              "optimizers take eval_dataset (scored after each epoch)", param="validation_dataset")
    stored = {
        "dataset": stored_dataset(request.dataset),
        "eval_dataset": None if request.eval_dataset is None else stored_dataset(request.eval_dataset),
        "validation_dataset": (None if request.validation_dataset is None
                               else stored_dataset(request.validation_dataset)),
        "loss": loss_spec,
        "optimizer": optimizer.to_dict(),
        "epochs": request.epochs,
        "batch_size": request.batch_size,
        "seed": request.seed,
        "shuffle": request.shuffle,
        "activate": request.activate,
        "max_concurrent": request.max_concurrent,
        "metadata": request.metadata,
        "learnable": learnable,
    }
    return repo.create_training(
        session, training_id=new_training_id(), pipeline_id=pipeline.id, pipeline_name=request.pipeline,
        owner=owner, request=storable(stored), total_steps=total_steps,
    )


def _selection_steps(session: Session, request: TrainingRequest, examples: list[Any], module: Any,
                     optimizer: OptimizerSpec, owner: str, limits: Limits) -> int:
    """Check what the gepa optimizer needs (a validation set, a budget that pays for a step) and estimate its
    steps."""
    validation = None
    if request.validation_dataset is not None:
        validation = load_examples(session, request.validation_dataset, owner=owner, limits=limits,
                                   param="validation_dataset")
        check_examples_fit(module, validation, request.pipeline, param="validation_dataset")
    train, held = split_validation(examples, validation, request.seed)
    check_budget(optimizer.budget, optimizer.minibatch_size, len(train), len(held))
    return estimated_steps(optimizer.budget, optimizer.minibatch_size, optimizer.candidates_per_step, len(train),
                           len(held))


# -- reading ----------------------------------------------------------------------------------------------------
def load_training(session: Session, training_id: str, owner: str | None = None) -> Training:
    row = runs.get_run(session, Training, run_id=training_id, owner=owner)
    if row is None:
        raise JobNotFound(f"no training {training_id!r}: list your trainings with GET /v1/trainings",
                          param="training_id", code="training_not_found")
    return row


def training_view(row: Training, steps: list[Any] | None = None) -> dict[str, Any]:
    request = row.request or {}
    view: dict[str, Any] = {
        "id": row.id,
        "object": "training",
        "pipeline": row.pipeline_name,
        "status": row.status,
        "epochs": request.get("epochs"),
        "validation_dataset": request.get("validation_dataset"),
        "batch_size": request.get("batch_size"),
        "seed": request.get("seed"),
        "loss": request.get("loss"),
        "optimizer": request.get("optimizer"),
        "metadata": request.get("metadata") or {},
        "progress": {"completed_steps": row.completed_steps, "total_steps": row.total_steps},
        "base_version": row.base_version,
        "final_version": row.final_version,
        "result": row.result,
        "error": row.error,
        "created_at": to_unix(row.created_at),
        "started_at": to_unix(row.started_at),
        "finished_at": to_unix(row.finished_at),
    }
    if steps is not None:
        view["steps"] = [
            {"step": s.step, "epoch": s.epoch, "batch": s.batch, "score": s.score, "scores": s.scores,
             "version": s.version, "updates": s.updates, "errors": s.errors}
            for s in steps
        ]
        view["candidates"] = candidate_views(steps)
    return view


def describe_training(session: Session, training_id: str, owner: str | None = None) -> dict[str, Any]:
    row = load_training(session, training_id, owner)
    return training_view(row, repo.training_steps(session, training_id=row.id))


def list_training_views(session: Session, *, owner: str | None, after: str | None = None,
                        limit: int = 20) -> dict[str, Any]:
    check_limit(limit)
    rows = runs.list_runs(session, Training, owner=owner, after=after, limit=limit + 1)
    return page(rows, limit, training_view)


def cancel_training(session: Session, training_id: str, owner: str | None = None) -> dict[str, Any]:
    """Ask a training to stop: ``cancelling`` at once, ``cancelled`` once its runner has stopped. The versions
    of the steps it finished stay; the active parameters do not change."""
    row = load_training(session, training_id, owner)
    if row.status in RUN_TERMINAL:
        raise JobConflict(f"training {training_id} is already {row.status}; there is nothing to cancel",
                          param="training_id", code="training_finished")
    if row.status == RunStatus.QUEUED:
        runs.finish_run(session, Training, run_id=row.id, status=RunStatus.CANCELLED)
    else:
        runs.request_cancel(session, Training, run_id=row.id)
    return describe_training(session, training_id, owner)


# -- running ----------------------------------------------------------------------------------------------------
class TrainingRun(SupervisedRun):
    """One claimed training, run in this process: ``await run()`` returns when it is terminal (or was stopped
    by a shutdown, in which case it stays ``running`` and the next claimer fails it as interrupted)."""

    kind = "training"

    def __init__(self, training_id: str, sessions: sessionmaker[Session], *,
                 resources_for: Callable[[list[str]], Any], feedback_poll: float = 0.5) -> None:
        self.id = training_id
        self.sessions = sessions
        self.resources_for = resources_for
        self.feedback_poll = feedback_poll
        self._versions: list[tuple[int, int]] = []  # (epoch, version) of each step version, in order

    async def _run(self) -> None:
        setup = await asyncio.to_thread(self._setup)
        if setup is None:
            return
        module, examples, held_out, validation, request, owner = setup
        loss = build_loss(request["loss"], human=lambda: database_source(
            self.sessions, training_id=self.id, owner=owner, interval=self.feedback_poll)).loss
        spec = parse_optimizer(request["optimizer"])
        if spec.selection:
            await self._run_selection(module, examples, validation, loss, spec, request)
            return
        optimizer = spec.build(module.parameters())
        aliases = pipeline_aliases(module) + spec.aliases() + _loss_aliases(request["loss"])
        resources = endpoints_for(self.resources_for, aliases)
        history = await train(
            module, examples, loss, optimizer, epochs=request["epochs"], batch_size=request["batch_size"],
            shuffle=request.get("shuffle", True), seed=request.get("seed"), eval_dataset=held_out,
            on_step=lambda step: asyncio.to_thread(self._store_step, module, step), resources=resources,
            max_concurrent=request.get("max_concurrent"),
        )
        result = {
            "train_scores": history.train_scores,
            "eval_scores": history.eval_scores,
            "step_scores": history.scores,
            "updates": len(history.updates),
            "changed": sum(1 for u in history.updates if u.changed),
            "initial_state": to_jsonable(history.initial_state),
            "final_state": to_jsonable(history.final_state),
        }
        eval_by_epoch = {e.epoch: e.eval_score for e in history.epochs}
        await asyncio.to_thread(self._complete, result, eval_by_epoch, bool(request.get("activate", True)))

    # -- database steps (worker threads) ----------------------------------------------------------------------
    def _status(self) -> str | None:
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Training, run_id=self.id)
            return row.status if row is not None else None

    def _setup(self) -> tuple[Any, list[Any], list[Any] | None, list[Any] | None, dict[str, Any], str] | None:
        """Load the training, its pipeline and datasets; record the version it starts from. None when the
        training cannot run (and was failed here)."""
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Training, run_id=self.id)
            if row is None:
                return None
            if row.attempts > 1:
                # train() keeps its state in memory: an interrupted training cannot continue where it stopped
                runs.finish_run(session, Training, run_id=self.id, status=RunStatus.FAILED, error={
                    "type": "Interrupted",
                    "message": f"the process running this training stopped at step {row.completed_steps} of "
                               f"{row.total_steps}; the versions of its finished steps are stored (activate one "
                               "with POST /v1/pipelines/{name}/parameters/versions/{version}/activate) or submit "
                               "the training again",
                })
                return None
            pipeline = repository.get_pipeline(session, pipeline_id=row.pipeline_id)
            assert pipeline is not None
            request = dict(row.request)
            limits = Limits(max_items=10**9, max_bytes=10**12)  # checked at submission
            examples = load_examples(session, request["dataset"], owner=row.owner, limits=limits)
            held_out = None
            if request.get("eval_dataset") is not None:
                held_out = load_examples(session, request["eval_dataset"], owner=row.owner, limits=limits,
                                         param="eval_dataset")
            validation = None
            if request.get("validation_dataset") is not None:
                validation = load_examples(session, request["validation_dataset"], owner=row.owner, limits=limits,
                                           param="validation_dataset")
            module = module_for(pipeline)
            if not repository.parameter_versions(session, pipeline_id=pipeline.id):
                # the first training of a pipeline stores its code's values as version 1, so they can be restored
                version = repo.append_parameter_version(
                    session, pipeline_id=pipeline.id, state=to_jsonable(module.state_dict()),
                    note="the pipeline's initial parameters", metadata={"source": "initial", "training_id": self.id},
                    activate=True,
                )
                base = version.version
            else:
                base = pipeline.parameter_version
            runs.set_progress(session, Training, run_id=self.id, base_version=base)
            return module, examples, held_out, validation, request, row.owner

    # -- the selection-gated optimizer ---------------------------------------------------------------------------
    async def _run_selection(self, module: Any, examples: list[Any], validation: list[Any] | None, loss: Any,
                             spec: OptimizerSpec, request: dict[str, Any]) -> None:
        train, held = split_validation(examples, validation, request.get("seed"))
        best_state: dict[str, Any] = {}

        def store(step: SelectionStep) -> Any:
            nonlocal best_state
            changes = best_changes(step, best_state)
            if step.step == 0 or changes:
                best_state = dict(next(c for c in step.candidates if c.best).state)
            return asyncio.to_thread(self._store_selection_step, module, step, changes)

        optimizer = spec.build_selection(module, loss, seed=request.get("seed"), on_step=store)
        aliases = pipeline_aliases(module) + optimizer.required_aliases() + _loss_aliases(request["loss"])
        resources = endpoints_for(self.resources_for, aliases)
        result = await optimizer.fit(train, held, resources=resources, max_concurrent=request.get("max_concurrent"))
        summary = {
            "optimizer": "gepa", "metric_calls": result.metric_calls, "budget": result.budget,
            "stopped": result.stopped, "steps": len(result.steps), "candidates": len(result.candidates),
            "accepted": sum(1 for c in result.candidates[1:] if c.accepted), "best_candidate": result.best.id,
            "val_scores": result.best_val_scores, "val_score": result.best.val_score,
            "train_examples": len(train), "validation_examples": len(held),
            "initial_state": to_jsonable(result.initial_state), "final_state": to_jsonable(result.final_state),
        }
        await asyncio.to_thread(self._complete, summary, {}, bool(request.get("activate", True)))

    def _store_selection_step(self, module: Any, step: SelectionStep, changes: list[dict[str, Any]]) -> None:
        """One step and its candidates; a new best (by validation score) becomes a stored parameter version,
        scored with its validation mean, so the versions a training adds only rise in score."""
        best = next((c for c in step.candidates if c.best), None)
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Training, run_id=self.id)
            assert row is not None
            version: ParameterVersion | None = None
            if changes and best is not None:
                version = repo.append_parameter_version(
                    session, pipeline_id=row.pipeline_id, state=to_jsonable({**module.state_dict(), **best.state}),
                    note=f"training {self.id}, step {step.step}: candidate {best.id}",
                    metadata={"source": "training", "training_id": self.id, "step": step.step,
                              "candidate": best.id, "val_score": best.val_score, "updates": to_jsonable(changes)},
                    activate=False,
                )
                repo.set_version_score(session, pipeline_id=row.pipeline_id, version=version.version,
                                       score=best.val_score)
                self._versions.append((0, version.version))
            repo.add_training_step(session, training_id=self.id,
                                   values=step_values(step, changes, version.version if version else None))
            runs.set_progress(session, Training, run_id=self.id, completed_steps=min(step.step, row.total_steps))

    def _store_step(self, module: Any, step: TrainingStep) -> None:
        changed = [u.to_dict() for u in step.updates if u.changed]
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Training, run_id=self.id)
            assert row is not None
            version: ParameterVersion | None = None
            if changed:
                version = repo.append_parameter_version(
                    session, pipeline_id=row.pipeline_id, state=to_jsonable(module.state_dict()),
                    note=f"training {self.id}, step {step.step}",
                    metadata={"source": "training", "training_id": self.id, "step": step.step,
                              "epoch": step.epoch, "batch_score": step.score, "batch_scores": step.scores,
                              "updates": to_jsonable(changed)},
                    activate=False,
                )
                self._versions.append((step.epoch, version.version))
            repo.add_training_step(session, training_id=self.id, values={
                "step": step.step, "epoch": step.epoch, "batch": step.batch, "score": step.score,
                "scores": list(step.scores), "updates": to_jsonable([u.to_dict() for u in step.updates]),
                "errors": {str(k): storable(v) for k, v in step.errors.items()},
                "version": version.version if version is not None else None,
            })
            runs.set_progress(session, Training, run_id=self.id, completed_steps=step.step)

    def _complete(self, result: dict[str, Any], eval_by_epoch: dict[int, float | None], activate: bool) -> None:
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Training, run_id=self.id)
            assert row is not None
            # an epoch's held-out score belongs to the last version that epoch produced
            last_of_epoch: dict[int, int] = {}
            for epoch, version in self._versions:
                last_of_epoch[epoch] = version
            for epoch, version in last_of_epoch.items():
                if eval_by_epoch.get(epoch) is not None:
                    repo.set_version_score(session, pipeline_id=row.pipeline_id, version=version,
                                           score=eval_by_epoch[epoch])
            final = self._versions[-1][1] if self._versions else row.base_version
            if activate and final is not None and self._versions:
                repo.activate_parameter_version(session, pipeline_id=row.pipeline_id, version=final)
            result["activated"] = bool(activate and self._versions)
            if row.completed_steps < row.total_steps:  # the step count was a plan: the optimizer stopped earlier
                runs.set_progress(session, Training, run_id=self.id, total_steps=row.completed_steps)
            runs.finish_run(session, Training, run_id=self.id, status=RunStatus.COMPLETED, final_version=final,
                            result=storable(result))
            repo.expire_feedback(session, training_id=self.id, note="the training finished")

    def _finish(self, status: RunStatus, values: dict[str, Any]) -> None:
        with session_scope(self.sessions) as session:
            row = runs.get_run(session, Training, run_id=self.id)
            final = self._versions[-1][1] if self._versions else (row.base_version if row is not None else None)
            runs.finish_run(session, Training, run_id=self.id, status=status, final_version=final, **values)
            repo.expire_feedback(session, training_id=self.id, note=f"the training is {status}")


def _loss_aliases(spec: dict[str, Any]) -> list[str]:
    # rebuilt without a human source: aliases do not depend on it
    return build_loss(spec, human=QueueFeedbackSource).aliases
