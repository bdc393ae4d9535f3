"""Response models of the platform's routes, for the OpenAPI document only: the routes still answer with
``JSONBytes`` (orjson) from the views ``app`` builds, and name these models with ``responses={200: {"model": X}}``.
The models live in ``app.client.types``, where the Python client returns them too. Each states the view's keys as
they are (a key that may be null is Optional; a key that is not always there has a default).
``tests/integration/api/test_response_models.py`` checks real answers against them."""

from api.schemas.common import created, ok
from app.client.types.files import Batch, BatchList, DeletedFile, FileList, FileObject
from app.client.types.jobs import ItemList, Job, JobList
from app.client.types.learning import (
    Evaluation,
    EvaluationList,
    ExampleComparison,
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

__all__ = [
    "Batch",
    "BatchList",
    "DeletedFile",
    "Evaluation",
    "EvaluationList",
    "ExampleComparison",
    "FileList",
    "FileObject",
    "ItemList",
    "Job",
    "JobList",
    "ParameterDiff",
    "ParameterVersion",
    "ParameterVersionList",
    "PipelineList",
    "Schedule",
    "ScheduleList",
    "ScheduleRuns",
    "Training",
    "TrainingList",
    "created",
    "ok",
]
