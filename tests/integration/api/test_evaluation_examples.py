"""An evaluation example by example (``GET /v1/evaluations/{id}/examples``), beside a baseline evaluation, and the
``dataset`` of the evaluation view; on the embedded default (SQLite) with a scripted classifier whose answers the
test changes between two evaluations."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from app.db import create_db_engine, make_session_factory, session_scope
from app.db.optimization_models import Evaluation, RunStatus
from app.db.repository import learning, runs
from app.jobs.learning.evaluations import MAX_OUTPUT_CHARS, stored_output
from app.jobs.learning.examples import compare_examples
from app.jobs.registry import current_registry
from app.jobs.runtime import JobsRuntime
from app.pipeline.resources.types import LLMRequest
from app.settings import Settings
from tests.support.fakes import ScriptedLM

ACME, GLOBEX = {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer sk-globex"}
DATASET = [
    {"input": "Great phone", "target": "positive"},
    {"input": "Awful battery", "target": "negative"},
    {"input": "Lovely screen", "target": "positive"},
    {"input": "it will explode", "target": "negative"},
    {"inputs": {"review": "Broke in a day"}, "target": "negative"},
]


class Classifier:
    """Labels reviews by their words; ``wrong`` lists words whose reviews it gets wrong; 'explode' fails."""

    def __init__(self) -> None:
        self.wrong: set[str] = set()

    def __call__(self, alias: str, request: LLMRequest) -> str:
        prompt = str(request.prompt)
        if "explode" in prompt:
            raise ValueError("the scripted model refuses this review")
        label = "positive" if any(w in prompt for w in ("Great", "Lovely")) else "negative"
        if any(w in prompt for w in self.wrong):
            label = "negative" if label == "positive" else "positive"
        return label


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Classifier]]:
    classifier = Classifier()
    config = Settings(data_dir=tmp_path_factory.mktemp("evals") / "state", jobs_poll_interval=0.05,
                      api_keys=["acme:sk-acme", "globex:sk-globex"])
    app = create_app(config, jobs=JobsRuntime(config, resources=ScriptedLM(classifier)))
    with TestClient(app) as client:
        yield client, classifier


def _evaluate(client: TestClient, dataset: Any, headers: dict[str, str] = ACME) -> dict[str, Any]:
    made = client.post("/v1/evaluations", json={"pipeline": "sentiment", "dataset": dataset, "metric": "exact"},
                       headers=headers)
    assert made.status_code == 201, made.text
    for _ in range(400):
        view = client.get(f"/v1/evaluations/{made.json()['id']}", headers=headers).json()
        if view["status"] in {"completed", "failed", "cancelled"}:
            assert view["status"] == "completed", view
            return dict(view)
        time.sleep(0.05)
    raise AssertionError(f"the evaluation did not finish: {view}")


@pytest.fixture(scope="module")
def pair(server: tuple[TestClient, Classifier]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A baseline evaluation (all right but the failing example), then one that gets 'Lovely' (example 2) and
    'Broke' (example 4) wrong."""
    client, classifier = server
    baseline = _evaluate(client, DATASET)
    classifier.wrong = {"Lovely", "Broke"}
    try:
        current = _evaluate(client, DATASET)
    finally:
        classifier.wrong = set()
    return baseline, current


def _examples(client: TestClient, evaluation_id: str, **params: Any) -> dict[str, Any]:
    response = client.get(f"/v1/evaluations/{evaluation_id}/examples", params=params, headers=ACME)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_evaluation_view_names_its_dataset(server: tuple[TestClient, Classifier],
                                           pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    client, _ = server
    baseline, _ = pair
    assert baseline["dataset"] == {"source": "inline", "file_id": None, "name": None, "examples": 5}
    listed = client.get("/v1/evaluations", headers=ACME).json()["data"]
    assert all(view["dataset"]["source"] == "inline" for view in listed)


def test_examples_of_one_evaluation(server: tuple[TestClient, Classifier],
                                    pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    client, _ = server
    baseline, _ = pair
    answer = _examples(client, baseline["id"])
    assert answer["object"] == "list" and answer["evaluation_id"] == baseline["id"]
    assert answer["baseline_id"] is None and answer["total"] == 5 and answer["has_more"] is False
    assert _examples(client, baseline["id"], baseline="") == answer  # an empty baseline is none
    assert answer["summary"] == {"count": 5, "mean": baseline["score"], "baseline_mean": None, "paired": 0,
                                 "improved": 0, "regressed": 0, "unchanged": 0}
    rows = answer["data"]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert set(rows[0]) == {"index", "input", "target", "output", "score", "feedback", "error", "baseline", "delta"}
    assert rows[0]["input"] == "Great phone" and rows[0]["target"] == "positive" and rows[0]["output"] == "positive"
    assert rows[0]["score"] == 1.0 and rows[0]["feedback"] and rows[0]["error"] is None
    assert rows[0]["baseline"] is None and rows[0]["delta"] is None
    assert rows[4]["input"] == {"review": "Broke in a day"}  # keyword arguments as an object
    failed = rows[3]
    assert failed["output"] is None and failed["score"] == 0.0 and "refuses" in failed["error"]  # counts as 0


def test_examples_beside_a_baseline(server: tuple[TestClient, Classifier],
                                    pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    client, _ = server
    baseline, current = pair
    answer = _examples(client, current["id"], baseline=baseline["id"])
    assert answer["baseline_id"] == baseline["id"]
    assert answer["summary"] == {"count": 5, "mean": current["score"], "baseline_mean": baseline["score"],
                                 "paired": 5, "improved": 0, "regressed": 2, "unchanged": 3}
    dropped = answer["data"][2]
    assert dropped["output"] == "negative" and dropped["score"] == 0.0
    assert dropped["baseline"] == {"output": "positive", "score": 1.0} and dropped["delta"] == -1.0
    assert answer["data"][0]["delta"] == 0.0 and answer["data"][3]["delta"] == 0.0  # failed in both: 0 - 0
    regressions = _examples(client, current["id"], baseline=baseline["id"], order="regressions")
    assert [r["index"] for r in regressions["data"]] == [2, 4, 0, 1, 3]  # the two drops first, then by index
    worst = _examples(client, current["id"], baseline=baseline["id"], order="regressions", limit=1)
    assert [r["index"] for r in worst["data"]] == [2] and worst["has_more"] is True and worst["total"] == 5
    below = _examples(client, current["id"], below=0.5)
    assert [r["index"] for r in below["data"]] == [2, 3, 4] and below["total"] == 3
    assert below["summary"]["count"] == 5  # the summary is of the whole evaluation
    page = _examples(client, current["id"], offset=3, limit=1)
    assert [r["index"] for r in page["data"]] == [3] and page["has_more"] is True


def test_datasets_of_different_lengths_pair_over_the_common_prefix(
        server: tuple[TestClient, Classifier], pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    client, classifier = server
    baseline, _ = pair
    classifier.wrong = {"Great"}
    try:
        short = _evaluate(client, DATASET[:3])
    finally:
        classifier.wrong = set()
    answer = _examples(client, baseline["id"], baseline=short["id"], order="regressions")
    assert answer["summary"]["paired"] == 3 and answer["summary"]["improved"] == 1
    assert answer["summary"]["unchanged"] == 2
    rows = answer["data"]
    # an improvement is no drop: the unchanged first, by index, then the improved, then the unpaired
    assert [r["index"] for r in rows] == [1, 2, 0, 3, 4]
    assert rows[2]["delta"] == 1.0 and rows[3]["baseline"] is None and rows[3]["delta"] is None


def test_a_file_dataset(server: tuple[TestClient, Classifier]) -> None:
    client, _ = server
    lines = "\n".join(json.dumps(example) for example in DATASET[:2]).encode()
    uploaded = client.post("/v1/files", files={"file": ("ds.jsonl", io.BytesIO(lines))},
                           data={"purpose": "user_data"}, headers=ACME)
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    view = _evaluate(client, file_id)
    assert view["dataset"] == {"source": "file", "file_id": file_id, "name": None, "examples": 2}
    rows = _examples(client, view["id"])["data"]
    assert [(r["input"], r["target"], r["output"]) for r in rows] == [
        ("Great phone", "positive", "positive"), ("Awful battery", "negative", "negative")]
    assert client.delete(f"/v1/files/{file_id}", headers=ACME).status_code == 200
    gone = _examples(client, view["id"])["data"]  # the file is gone: the stored results remain
    assert [(r["input"], r["target"], r["output"]) for r in gone] == [
        (None, None, "positive"), (None, None, "negative")]


def test_a_registered_dataset(server: tuple[TestClient, Classifier]) -> None:
    client, _ = server
    view = _evaluate(client, {"name": "sentiment:test"})
    split = current_registry().dataset("sentiment:test")
    assert view["dataset"] == {"source": "registered", "file_id": None, "name": "sentiment:test",
                               "examples": len(split)}
    first = split[0]
    row = _examples(client, view["id"], limit=1)["data"][0]
    assert (row["input"], row["target"]) == (first["input"], first["target"]) and row["output"] is not None


@pytest.mark.parametrize(("params", "status", "param"), [
    ({"baseline": "eval_nope"}, 404, "baseline"),
    ({"order": "worst"}, 400, "order"),
    ({"limit": 0}, 400, "limit"),
    ({"limit": 501}, 400, "limit"),
    ({"offset": -1}, 400, "offset"),
    ({"below": "nan"}, 400, "below"),
    ({"below": "low"}, 400, "below"),
])
def test_bad_parameters(server: tuple[TestClient, Classifier], pair: tuple[dict[str, Any], dict[str, Any]],
                        params: dict[str, Any], status: int, param: str) -> None:
    client, _ = server
    response = client.get(f"/v1/evaluations/{pair[1]['id']}/examples", params=params, headers=ACME)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and set(error) == {"message", "type", "param", "code"}


def test_tenants_stay_apart(server: tuple[TestClient, Classifier],
                            pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    client, _ = server
    current = pair[1]
    foreign = _evaluate(client, DATASET[:1], headers=GLOBEX)
    response = client.get(f"/v1/evaluations/{current['id']}/examples", params={"baseline": foreign["id"]},
                          headers=ACME)
    assert response.status_code == 404 and response.json()["error"]["param"] == "baseline"
    response = client.get(f"/v1/evaluations/{current['id']}/examples", headers=GLOBEX)
    assert response.status_code == 404 and response.json()["error"]["param"] == "evaluation_id"


def test_unfinished_and_older_evaluations(tmp_path: Path) -> None:
    """Straight on the database: a queued evaluation (nothing stored yet) and one finished before outputs were
    kept."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    from app.db.migrate import upgrade

    upgrade(url)
    engine = create_db_engine(url)
    sessions = make_session_factory(engine)
    try:
        with session_scope(sessions) as session:
            from app.db import repository

            pipeline = repository.get_or_create_pipeline(session, owner="acme", name="p", import_path="p")
            for evaluation_id in ("eval_queued", "eval_old"):
                learning.create_evaluation(session, evaluation_id=evaluation_id, pipeline_id=pipeline.id,
                                           pipeline_name="sentiment", owner="acme", total_examples=2,
                                           request={"dataset": DATASET[:2], "loss": None})
            runs.finish_run(session, Evaluation, run_id="eval_old", status=RunStatus.COMPLETED, score=0.5,
                            scores=[1.0, 0.0], details={"feedback": ["ok", "no"], "errors": {}, "failures": 0})
        with session_scope(sessions) as session:
            queued = compare_examples(session, "eval_queued", owner="acme")
            assert [(r["input"], r["output"], r["score"]) for r in queued["data"]] == [
                ("Great phone", None, None), ("Awful battery", None, None)]
            assert queued["summary"]["mean"] is None and queued["summary"]["count"] == 2
            old = compare_examples(session, "eval_old", owner="acme", baseline="eval_queued")
            assert [(r["output"], r["score"], r["feedback"]) for r in old["data"]] == [
                (None, 1.0, "ok"), (None, 0.0, "no")]
            assert old["summary"]["paired"] == 0 and old["data"][0]["baseline"] is None  # nothing to pair with yet
    finally:
        engine.dispose()


def test_stored_outputs_are_bounded() -> None:
    assert stored_output({"label": "positive", "n": (1, 2)}) == {"label": "positive", "n": [1, 2]}
    cut = stored_output("x" * (MAX_OUTPUT_CHARS * 2))
    assert isinstance(cut, str) and len(cut) < MAX_OUTPUT_CHARS + 100 and cut.endswith("characters]")
