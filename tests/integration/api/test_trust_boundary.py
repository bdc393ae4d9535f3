"""Nothing a request sends runs code on the host: names of pipelines, losses and metrics come from the operator's
registry, and a name that is not registered is a 400 (or a 404 for a resource path) with nothing imported.

Each case is tried over HTTP on a server without API keys (the default), the way an attacker who reaches the port
would. An importable module planted on ``sys.path`` writes a marker file when imported: the marker must never
appear, and ``sys.modules`` must never gain a module a request named."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from api.main import create_app
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.serving_fakes import FakeBackend

PLANTED = "planted_by_request_xyz"
DATASET = [{"input": "Great phone", "target": "positive"}, {"input": "Awful", "target": "negative"}]


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[Path]:
    """A module that, if anything imported it, would write ``marker`` (and could do anything else)."""
    marker = tmp_path / "marker"
    (tmp_path / f"{PLANTED}.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "def check(output, target):\n    return True, ''\n"
        "def make(**options):\n    return None\n"
        "class Pipe:\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop(PLANTED, None)
    sys.modules.pop("this", None)  # `import this` prints the Zen of Python: a visible side effect
    yield marker
    sys.path.remove(str(tmp_path))
    sys.modules.pop(PLANTED, None)


@pytest.fixture
def client(committed: Engine) -> Iterator[TestClient]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), jobs_poll_interval=0.05)
    lm = ScriptedLM(lambda alias, request: "positive")
    app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=lm))
    with TestClient(app) as test_client:
        yield test_client


def _refused(client: TestClient, path: str, body: dict[str, Any], param: str, status: int = 400) -> str:
    response = client.post(path, json=body)
    assert response.status_code == status, (path, body, response.text)
    error = response.json()["error"]
    assert str(error["param"]).startswith(param), error
    return str(error["message"])


def _nothing_ran(marker: Path, command_marker: Path) -> None:
    assert not marker.exists() and not command_marker.exists()
    assert PLANTED not in sys.modules and "this" not in sys.modules


def test_losses_and_metrics_are_registered_names(client: TestClient, planted: Path, tmp_path: Path) -> None:
    touched = tmp_path / "touched-by-os-system"
    shell = {"type": "python", "path": "os:system", "options": {"command": f"touch {touched}"}}
    message = _refused(client, "/v1/trainings", {"pipeline": "sentiment", "dataset": DATASET, "loss": shell}, "loss")
    assert "unknown loss 'os:system'" in message
    for loss in ({"type": "python", "name": f"{PLANTED}:make"}, {"type": "verifier", "function": f"{PLANTED}:check"},
                 {"type": "composite", "losses": [{"loss": {"type": "python", "path": f"{PLANTED}:make"}}]}):
        _refused(client, "/v1/trainings", {"pipeline": "sentiment", "dataset": DATASET, "loss": loss}, "loss")
        _refused(client, "/v1/evaluations", {"pipeline": "sentiment", "dataset": DATASET, "loss": loss}, "loss")
    for metric in ("os:system", f"{PLANTED}:check", "subprocess:getoutput"):
        message = _refused(client, "/v1/evaluations", {"pipeline": "sentiment", "dataset": DATASET, "metric": metric},
                           "metric")
        assert f"unknown metric {metric!r}" in message and "registered metrics" in message
        _refused(client, "/v1/evaluations/schedules", {"pipeline": "sentiment", "dataset": DATASET,
                                                       "metric": metric, "cron": "0 3 * * *"}, "metric")
    assert client.get("/v1/evaluations").json()["data"] == []
    _nothing_ran(planted, touched)


def test_pipelines_are_registered_names(client: TestClient, planted: Path, tmp_path: Path) -> None:
    for name in ("this:s", f"{PLANTED}:Pipe", "os:system", "app.jobs.registry:Registry"):
        message = _refused(client, "/v1/jobs", {"pipeline": name, "inputs": ["x"]}, "pipeline")
        assert "unknown pipeline" in message and "review-compare, review-extract, sentiment" in message
        _refused(client, "/v1/trainings", {"pipeline": name, "dataset": DATASET, "metric": "exact"}, "pipeline")
        _refused(client, "/v1/evaluations", {"pipeline": name, "dataset": DATASET, "metric": "exact"}, "pipeline")
        versions = client.get(f"/v1/pipelines/{name}/parameters/versions")
        assert versions.status_code == 404, versions.text
        assert client.post(f"/v1/pipelines/{name}/parameters/versions/1/activate").status_code == 404
    assert client.get("/v1/jobs").json()["data"] == []
    _nothing_ran(planted, tmp_path / "none")


def test_tagged_json_in_inputs_stays_data(client: TestClient, planted: Path, tmp_path: Path) -> None:
    """The stored-value encoding has a ``$type`` tag (a class by path): a request's own ``$type`` key is data."""
    hostile = {"$type": f"{PLANTED}:Pipe", "$value": {"kind": "x"}, "$bytes": "AAAA"}
    created = client.post("/v1/jobs", json={"pipeline": "sentiment", "inputs": [{"custom_id": "1", "input": {"review": hostile}}]})
    assert created.status_code == 201, created.text
    deadline = time.monotonic() + 15
    while (view := client.get(f"/v1/jobs/{created.json()['id']}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, view
        time.sleep(0.05)
    assert view["status"] == "completed", view
    lines = client.get(f"/v1/jobs/{created.json()['id']}/results").text.splitlines()
    assert json.loads(lines[0])["status"] == "completed"
    _nothing_ran(planted, tmp_path / "none")
