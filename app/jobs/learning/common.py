"""What trainings and evaluations share: resolving the pipeline, reading and checking datasets, the endpoint
aliases a run calls and the endpoints that serve them, and the page shape of their listings."""

from __future__ import annotations

import abc
import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from app.db import Pipeline, repository
from app.db.optimization_models import RunStatus
from app.jobs.encoding import storable
from app.jobs.endpoints import NO_ENDPOINTS_HINT
from app.jobs.errors import InvalidJobInput, JobNotFound
from app.jobs.graphs import import_path_of, load_module, shape_key, trace_item
from app.jobs.inputs import InputFileError
from app.jobs.learning.specs import (
    dataset_file_id,
    dataset_name,
    decode_file,
    examples_from_jsonl,
    named_examples,
    parse_examples,
)
from app.jobs.registry import UnknownPipelineError, load_pipeline_class
from app.jobs.submission import Limits
from app.pipeline.optimization import Example
from app.pipeline.optimization.llm import missing_aliases
from app.pipeline.resources.errors import ConfigurationError

MAX_PAGE = 100

log = logging.getLogger(__name__)


def check_pipeline(name: Any) -> str:
    """The import path of a registered pipeline name, or InvalidJobInput (400) listing the registered names.
    Nothing is imported for a name the operator did not register."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidJobInput("pipeline is required: the name of a registered pipeline", param="pipeline")
    try:
        load_pipeline_class(name)
    except UnknownPipelineError as exc:
        raise InvalidJobInput(str(exc), param="pipeline", code="unknown_pipeline") from None
    return import_path_of(name)


def registered_pipeline(session: Session, name: str, *, owner: str) -> Pipeline:
    """The tenant's row of a registered pipeline (short names resolve to their import path), made once."""
    path = check_pipeline(name)
    return repository.get_or_create_pipeline(session, owner=owner, name=path, import_path=path)


def find_pipeline(session: Session, name: str, *, owner: str) -> Pipeline:
    """The tenant's existing pipeline row, or 404: reading versions must not register a pipeline."""
    try:
        path = import_path_of(name)
    except UnknownPipelineError as exc:
        raise JobNotFound(str(exc), param="pipeline", code="pipeline_not_found") from None
    pipeline = repository.get_pipeline_by_name(session, owner=owner, name=path)
    if pipeline is None:
        raise JobNotFound(f"pipeline {name!r} has no parameter versions yet: submit a job, a training or an "
                          "evaluation of it first", param="pipeline", code="pipeline_not_found")
    return pipeline


def load_examples(session: Session, dataset: Any, *, owner: str | None, limits: Limits,
                  param: str = "dataset") -> list[Example]:
    """The examples of an inline dataset, of a registered one (by name) or of an uploaded JSONL file (one example
    per line)."""
    name = dataset_name(dataset)
    if name is not None:
        return named_examples(name, param=param, max_items=limits.max_items)
    file_id = dataset_file_id(dataset)
    if file_id is None:
        return parse_examples(dataset, param=param, max_items=limits.max_items)
    file = repository.get_file(session, file_id=file_id, owner=owner)
    if file is None:
        raise InvalidJobInput(f"no uploaded file {file_id!r}: upload the JSONL dataset with POST /v1/files first, "
                              "or name a registered dataset such as 'sentiment:train'", param=param,
                              code="file_not_found")
    try:
        text = decode_file(file.content, file_id)
    except InputFileError as exc:
        raise InvalidJobInput(str(exc), param=param) from None
    return examples_from_jsonl(text, source=f"file {file_id}", param=param, max_items=limits.max_items)


def stored_dataset(dataset: Any) -> Any:
    """How a request's dataset is kept: a registered name, a file reference, or the inline examples as given."""
    name = dataset_name(dataset)
    if name is not None:
        return {"name": name}
    file_id = dataset_file_id(dataset)
    return {"file_id": file_id} if file_id is not None else dataset


def check_examples_fit(module: Any, examples: Sequence[Example], name: str, param: str = "dataset") -> None:
    """Trace one example per input shape: an example that does not fit forward is refused before any run."""
    seen: set[Any] = set()
    for index, example in enumerate(examples):
        key = shape_key((example.args, example.kwargs))
        if key in seen:
            continue
        seen.add(key)
        try:
            trace_item(module, example.args, example.kwargs)
        except Exception as exc:
            raise InvalidJobInput(f"{param}[{index}] does not fit pipeline {name!r}: {type(exc).__name__}: {exc}",
                                  param=param) from None


def module_for(pipeline: Pipeline, state: dict[str, Any] | None = None) -> Any:
    """A fresh instance of the pipeline with ``state`` (default: its active parameters) applied."""
    try:
        return load_module(pipeline.import_path, pipeline.parameter_state if state is None else state)
    except UnknownPipelineError as exc:
        raise InvalidJobInput(str(exc), param="pipeline", code="unknown_pipeline") from None


def pipeline_aliases(module: Any) -> list[str]:
    """Every endpoint alias the pipeline's modules call."""
    return sorted({m.alias for m in module.modules() if isinstance(getattr(m, "alias", None), str)})


def endpoints_for(resources_for: Any, aliases: list[str]) -> Any:
    """The endpoints serving ``aliases``, or a ConfigurationError that names what is missing and how to fix it."""
    try:
        resources = resources_for(sorted(set(aliases)))
    except Exception as exc:
        raise ConfigurationError(f"the endpoints are not available: {exc}; {NO_ENDPOINTS_HINT}") from exc
    missing = missing_aliases(resources, sorted(set(aliases)))
    if missing:
        raise ConfigurationError(
            f"the run calls the endpoint alias(es) {', '.join(missing)}, which the server's resources do not "
            f"define: {NO_ENDPOINTS_HINT}"
        )
    return resources


def steps_of(examples: int, batch_size: int, epochs: int) -> int:
    return epochs * math.ceil(examples / batch_size)


def page(rows: list[Any], limit: int, view: Any) -> dict[str, Any]:
    shown = rows[:limit]
    return {
        "object": "list",
        "data": [view(row) for row in shown],
        "first_id": shown[0].id if shown else None,
        "last_id": shown[-1].id if shown else None,
        "has_more": len(rows) > limit,
    }


def check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidJobInput(f"limit must be between 1 and {MAX_PAGE}, not {limit}", param="limit")


class SupervisedRun(abc.ABC):
    """What every training and evaluation run does around its work (``_run``): a cancel that arrives while it
    runs ends it as cancelled, any other failure as failed with the error stored. Subclasses give ``id``,
    ``kind`` (for the log), ``_run``, ``_status`` and ``_finish``."""

    id: str
    kind = "run"

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            if await asyncio.to_thread(self._status) == RunStatus.CANCELLING:
                await asyncio.to_thread(self._finish, RunStatus.CANCELLED, {})
            raise
        except Exception as exc:
            log.warning("%s %s failed: %s: %s", self.kind, self.id, type(exc).__name__, exc)
            await asyncio.to_thread(self._finish, RunStatus.FAILED,
                                    {"error": {"type": type(exc).__name__, "message": storable(str(exc))}})

    @abc.abstractmethod
    async def _run(self) -> None:
        """The run's own work."""

    @abc.abstractmethod
    def _status(self) -> str | None:
        """The run's stored status."""

    @abc.abstractmethod
    def _finish(self, status: RunStatus, values: dict[str, Any]) -> None:
        """Store the run's terminal status and values."""
