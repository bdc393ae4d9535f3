"""The OpenAPI document names a response model for the platform's main routes (the routes answer with orjson
bytes, so FastAPI cannot infer one), and the strict check that integration tests run against it catches a model
that does not match an answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.main import create_app
from app.settings import Settings
from tests.support.openapi import ResponseChecker
from tests.support.serving_fakes import FakeBackend

MODELLED = [
    ("POST", "/v1/jobs", 201, "Job"),
    ("GET", "/v1/jobs", 200, "JobList"),
    ("GET", "/v1/jobs/{job_id}", 200, "Job"),
    ("POST", "/v1/jobs/{job_id}/cancel", 200, "Job"),
    ("GET", "/v1/jobs/{job_id}/items", 200, "ItemList"),
    ("POST", "/v1/evaluations", 201, "Evaluation"),
    ("GET", "/v1/evaluations", 200, "EvaluationList"),
    ("GET", "/v1/evaluations/{evaluation_id}", 200, "Evaluation"),
    ("POST", "/v1/evaluations/{evaluation_id}/cancel", 200, "Evaluation"),
    ("GET", "/v1/evaluations/{evaluation_id}/examples", 200, "ExampleComparison"),
    ("POST", "/v1/evaluations/schedules", 201, "Schedule"),
    ("GET", "/v1/evaluations/schedules", 200, "ScheduleList"),
    ("GET", "/v1/evaluations/schedules/{schedule_id}", 200, "Schedule"),
    ("GET", "/v1/evaluations/schedules/{schedule_id}/runs", 200, "ScheduleRuns"),
    ("POST", "/v1/evaluations/schedules/{schedule_id}/pause", 200, "Schedule"),
    ("POST", "/v1/evaluations/schedules/{schedule_id}/resume", 200, "Schedule"),
    ("POST", "/v1/trainings", 201, "Training"),
    ("GET", "/v1/trainings", 200, "TrainingList"),
    ("GET", "/v1/trainings/{training_id}", 200, "Training"),
    ("POST", "/v1/trainings/{training_id}/cancel", 200, "Training"),
    ("GET", "/v1/pipelines", 200, "PipelineList"),
    ("GET", "/v1/pipelines/{name}/parameters/versions", 200, "ParameterVersionList"),
    ("GET", "/v1/pipelines/{name}/parameters/versions/diff", 200, "ParameterDiff"),
    ("GET", "/v1/pipelines/{name}/parameters/versions/{version}", 200, "ParameterVersion"),
    ("POST", "/v1/pipelines/{name}/parameters/versions/{version}/activate", 200, "ParameterVersion"),
    ("POST", "/v1/files", 200, "FileObject"),
    ("GET", "/v1/files", 200, "FileList"),
    ("GET", "/v1/files/{file_id}", 200, "FileObject"),
    ("DELETE", "/v1/files/{file_id}", 200, "DeletedFile"),
    ("POST", "/v1/batches", 200, "Batch"),
    ("GET", "/v1/batches", 200, "BatchList"),
    ("GET", "/v1/batches/{batch_id}", 200, "Batch"),
    ("POST", "/v1/batches/{batch_id}/cancel", 200, "Batch"),
]


@pytest.fixture(scope="module")
def checker(tmp_path_factory: pytest.TempPathFactory) -> ResponseChecker:
    app = create_app(Settings(data_dir=Path(tmp_path_factory.mktemp("openapi"))), backend=FakeBackend())
    return ResponseChecker(app.openapi())


@pytest.mark.parametrize(("method", "path", "status", "model"), MODELLED)
def test_the_route_names_its_response_model(checker: ResponseChecker, method: str, path: str, status: int,
                                            model: str) -> None:
    assert checker.schema_name(method, path, status) == model
    assert model in checker.document["components"]["schemas"]


def test_exports_are_documented_as_files(checker: ResponseChecker) -> None:
    answer = checker.document["paths"]["/v1/jobs/{job_id}/items/export"]["get"]["responses"]["200"]
    assert set(answer["content"]) == {"application/x-ndjson", "text/csv"}


def _item(**changes: Any) -> dict[str, Any]:
    row = {"custom_id": "a", "position": 0, "status": "completed", "input": "x", "output": {"label": "y"},
           "error": None, "latency_ms": 1.5, "started_at": 1, "finished_at": 2}
    return {"object": "list", "data": [{**row, **changes}], "total": 1, "offset": 0, "limit": 50,
            "has_more": False}


@pytest.mark.parametrize("body", [
    _item(extra="a key the model does not name"),
    _item(position=None),  # not nullable
    _item(status="done"),  # not an item status
    {k: v for k, v in _item().items() if k != "total"},  # a required key missing
])
def test_the_strict_check_catches_a_model_that_does_not_match(checker: ResponseChecker, body: Any) -> None:
    checker.check("GET", "/v1/jobs/{job_id}/items", 200, _item())
    with pytest.raises(AssertionError):
        checker.check("GET", "/v1/jobs/{job_id}/items", 200, body)
