"""A job's items for the console: ``GET /v1/jobs/{id}/items`` (filters, search, order, pages), its export
(``/items/export``, JSON Lines and CSV, streamed page by page) and ``GET /v1/jobs`` filtered by pipeline with each
job's usage. On SQLite (the embedded default) with a scripted LLM, and on PostgreSQL where the queries differ by
dialect (the text search over JSON, the merged per-status pages); a 50,000-item job's page is timed on both."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from api.main import create_app
from app.db import create_db_engine
from app.db.migrate import upgrade
from app.jobs.runtime import JobsRuntime
from app.pipeline.resources.types import LLMRequest
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.job_items import seed_job, status_of

ACME, GLOBEX = {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer sk-globex"}
KEYS = ["acme:sk-acme", "globex:sk-globex"]
TERMINAL = {"completed", "failed", "cancelled"}
INPUTS = [
    {"custom_id": "a", "input": "Great phone"},
    {"custom_id": "b", "input": "it will explode"},
    {"custom_id": "c", "input": 'Café "crème", très bien'},
    {"custom_id": "d", "input": {"review": "keyword review"}},
    {"custom_id": "e", "input": "explode again"},
    {"custom_id": "f", "input": "Lovely 100%_done"},
]


def reply(alias: str, request: LLMRequest) -> str:
    if "explode" in str(request.prompt):
        raise ValueError("the scripted model refuses this review")
    return "positive"


def _client(config: Settings) -> TestClient:
    return TestClient(create_app(config, jobs=JobsRuntime(config, resources=ScriptedLM(reply))))


@pytest.fixture(scope="module")
def sqlite_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    config = Settings(data_dir=tmp_path_factory.mktemp("items") / "state", api_keys=KEYS, jobs_poll_interval=0.05)
    with _client(config) as client:
        yield client


@pytest.fixture(scope="module")
def finished_job(sqlite_client: TestClient) -> str:
    """A finished job of six items, two of which failed (the model refuses reviews that say 'explode')."""
    created = sqlite_client.post("/v1/jobs", json={"pipeline": "sentiment", "inputs": INPUTS}, headers=ACME)
    assert created.status_code == 201, created.text
    return _wait(sqlite_client, created.json()["id"])["id"]


def _wait(client: TestClient, job_id: str) -> dict[str, Any]:
    for _ in range(400):
        view = client.get(f"/v1/jobs/{job_id}", headers=ACME).json()
        if view["status"] in TERMINAL:
            return view
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {view}")


def _items(client: TestClient, job_id: str, **params: Any) -> dict[str, Any]:
    response = client.get(f"/v1/jobs/{job_id}/items", params=params, headers=ACME)
    assert response.status_code == 200, response.text
    return response.json()


def _ids(page: dict[str, Any]) -> list[str]:
    return [row["custom_id"] for row in page["data"]]


def _error(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return dict(error)


# -- the table ---------------------------------------------------------------------------------------------------
def test_items_show_inputs_outputs_errors_and_latency(sqlite_client: TestClient, finished_job: str) -> None:
    page = _items(sqlite_client, finished_job)
    assert {k: page[k] for k in ("object", "total", "offset", "limit", "has_more")} == {
        "object": "list", "total": 6, "offset": 0, "limit": 50, "has_more": False}
    assert _ids(page) == ["a", "b", "c", "d", "e", "f"] and [r["position"] for r in page["data"]] == list(range(6))
    rows = {row["custom_id"]: row for row in page["data"]}
    assert set(rows["a"]) == {"custom_id", "position", "status", "input", "output", "error", "latency_ms",
                              "started_at", "finished_at"}
    # the input as submitted (not its stored graph encoding): a string, or keyword arguments as an object
    assert rows["a"]["input"] == "Great phone" and rows["d"]["input"] == {"review": "keyword review"}
    assert rows["c"]["input"] == 'Café "crème", très bien'
    assert rows["a"]["status"] == "completed" and rows["a"]["output"] == "positive" and rows["a"]["error"] is None
    assert rows["b"]["status"] == "failed" and rows["b"]["output"] is None
    assert "refuses" in rows["b"]["error"]["message"]
    for row in page["data"]:
        assert isinstance(row["latency_ms"], float) and row["latency_ms"] >= 0
        assert isinstance(row["finished_at"], int) and row["started_at"] <= row["finished_at"]


def test_items_filter_order_and_pages(sqlite_client: TestClient, finished_job: str) -> None:
    failed = _items(sqlite_client, finished_job, status="failed")
    assert _ids(failed) == ["b", "e"] and failed["total"] == 2
    both = _items(sqlite_client, finished_job, status="failed, completed")
    assert _ids(both) == ["a", "b", "c", "d", "e", "f"]
    assert _items(sqlite_client, finished_job, status="pending,running")["data"] == []
    assert _ids(_items(sqlite_client, finished_job, order="failures_first")) == ["b", "e", "a", "c", "d", "f"]
    first = _items(sqlite_client, finished_job, order="failures_first", limit=3)
    assert _ids(first) == ["b", "e", "a"] and first["total"] == 6 and first["has_more"] is True
    rest = _items(sqlite_client, finished_job, order="failures_first", offset=3, limit=3)
    assert _ids(rest) == ["c", "d", "f"] and rest["has_more"] is False and rest["offset"] == 3
    assert _items(sqlite_client, finished_job, offset=10)["data"] == []
    completed = _items(sqlite_client, finished_job, status="completed", limit=2, offset=2)
    assert _ids(completed) == ["d", "f"] and completed["total"] == 4 and completed["has_more"] is False


@pytest.mark.parametrize(("q", "expected"), [
    ("GREAT", ["a"]),  # case-insensitive, in the input
    ("crème", ["c"]),  # non-ASCII (SQLite's JSON text holds it as \\u00e8)
    ("CRÈME", ["c"]),
    ('"crème"', ["c"]),  # quotes, escaped in the JSON text
    ("keyword", ["d"]),  # inside keyword arguments
    ("refuses", ["b", "e"]),  # in the error
    ("positive", ["a", "c", "d", "f"]),  # in the output
    ("e", ["a", "b", "c", "d", "e", "f"]),
    ("100%_", ["f"]),  # LIKE's wildcards are plain characters
    ("%", ["f"]),
    ("%_d", ["f"]),
    ("nowhere", []),
])
def test_items_search(sqlite_client: TestClient, finished_job: str, q: str, expected: list[str]) -> None:
    page = _items(sqlite_client, finished_job, q=q)
    assert _ids(page) == expected and page["total"] == len(expected)


def test_items_search_custom_id_and_combined_filters(sqlite_client: TestClient, finished_job: str) -> None:
    created = sqlite_client.post("/v1/jobs", json={"pipeline": "sentiment", "inputs": [
        {"custom_id": "Order-17", "input": "fine"}, {"custom_id": "other", "input": "explode"}]}, headers=ACME)
    job_id = _wait(sqlite_client, created.json()["id"])["id"]
    assert _ids(_items(sqlite_client, job_id, q="order-1")) == ["Order-17"]
    assert _ids(_items(sqlite_client, finished_job, q="explode", status="failed", order="failures_first")) == [
        "b", "e"]
    page = _items(sqlite_client, finished_job, q="e", status="completed", limit=1, offset=1)
    assert _ids(page) == ["c"] and page["total"] == 4 and page["has_more"] is True


@pytest.mark.parametrize(("params", "param", "words"), [
    ({"status": "done"}, "status", "unknown item status 'done'"),
    ({"status": "failed,bogus"}, "status", "'bogus'"),
    ({"order": "newest"}, "order", "unknown order 'newest'"),
    ({"limit": 0}, "limit", ""),
    ({"limit": 501}, "limit", ""),
    ({"offset": -1}, "offset", ""),
    ({"offset": "many"}, "offset", ""),
    ({"q": "x" * 1001}, "q", "at most 1000"),
])
def test_items_bad_parameters_are_400(sqlite_client: TestClient, finished_job: str, params: dict[str, Any],
                                      param: str, words: str) -> None:
    response = sqlite_client.get(f"/v1/jobs/{finished_job}/items", params=params, headers=ACME)
    assert words in _error(response, 400, param)["message"]


def test_items_and_export_belong_to_the_jobs_tenant(sqlite_client: TestClient, finished_job: str) -> None:
    for path in ("items", "items/export"):
        _error(sqlite_client.get(f"/v1/jobs/{finished_job}/{path}", headers=GLOBEX), 404, "job_id")
        _error(sqlite_client.get(f"/v1/jobs/job_nope/{path}", headers=ACME), 404, "job_id")
        assert sqlite_client.get(f"/v1/jobs/{finished_job}/{path}").status_code == 401


# -- the export --------------------------------------------------------------------------------------------------
def test_export_jsonl_has_the_tables_rows(sqlite_client: TestClient, finished_job: str) -> None:
    response = sqlite_client.get(f"/v1/jobs/{finished_job}/items/export", headers=ACME)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
    assert response.headers["content-disposition"] == f'attachment; filename="{finished_job}.items.jsonl"'
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines == _items(sqlite_client, finished_job)["data"]
    filtered = sqlite_client.get(f"/v1/jobs/{finished_job}/items/export",
                                 params={"order": "failures_first", "q": "e", "status": "failed,completed"},
                                 headers=ACME)
    assert [json.loads(line)["custom_id"] for line in filtered.text.splitlines()] == [
        "b", "e", "a", "c", "d", "f"]


def test_export_csv(sqlite_client: TestClient, finished_job: str) -> None:
    response = sqlite_client.get(f"/v1/jobs/{finished_job}/items/export", params={"format": "csv"}, headers=ACME)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    assert response.headers["content-disposition"] == f'attachment; filename="{finished_job}.items.csv"'
    rows = list(csv.reader(io.StringIO(response.text)))
    assert rows[0] == ["custom_id", "status", "input", "output", "error", "latency_ms"]
    table = {row[0]: row for row in rows[1:]}
    assert list(table) == ["a", "b", "c", "d", "e", "f"]
    assert table["c"][:4] == ["c", "completed", 'Café "crème", très bien', "positive"]  # strings as they are
    assert json.loads(table["d"][2]) == {"review": "keyword review"}  # anything else as JSON
    assert table["a"][4] == "null" and json.loads(table["b"][4])["type"] == "ValueError"
    assert isinstance(json.loads(table["a"][5]), float)


@pytest.mark.parametrize(("params", "param"), [
    ({"format": "xml"}, "format"), ({"format": ""}, "format"), ({"status": "nope"}, "status"),
    ({"order": "random"}, "order"),
])
def test_export_bad_parameters_are_400(sqlite_client: TestClient, finished_job: str, params: dict[str, Any],
                                       param: str) -> None:
    _error(sqlite_client.get(f"/v1/jobs/{finished_job}/items/export", params=params, headers=ACME), 400, param)


# -- the jobs listing --------------------------------------------------------------------------------------------
def test_jobs_listing_by_pipeline_with_usage(sqlite_client: TestClient, finished_job: str) -> None:
    compare = sqlite_client.post("/v1/jobs", json={"pipeline": "app.examples.sentiment:SentimentLabel",
                                                   "inputs": ["fine"]}, headers=ACME).json()
    _wait(sqlite_client, compare["id"])
    listing = sqlite_client.get("/v1/jobs", params={"pipeline": "sentiment"}, headers=ACME).json()
    assert listing["data"] and all(job["pipeline"] == "sentiment" for job in listing["data"])
    ids = [job["id"] for job in listing["data"]]
    assert finished_job in ids and compare["id"] not in ids
    assert ids == sorted(ids, reverse=True)  # newest first
    single = sqlite_client.get(f"/v1/jobs/{finished_job}", headers=ACME).json()
    listed = next(job for job in listing["data"] if job["id"] == finished_job)
    assert listed == single and listed["usage"]["llm_calls"] == 4  # the four calls that answered
    by_path = sqlite_client.get("/v1/jobs", params={"pipeline": "app.examples.sentiment:SentimentLabel"},
                                headers=ACME).json()
    assert [job["id"] for job in by_path["data"]] == [compare["id"]]  # the name exactly as submitted
    assert sqlite_client.get("/v1/jobs", params={"pipeline": "sentiment"}, headers=GLOBEX).json()["data"] == []
    assert sqlite_client.get("/v1/jobs", params={"pipeline": "nope"}, headers=ACME).json()["data"] == []
    unfiltered = sqlite_client.get("/v1/jobs", params={"pipeline": ""}, headers=ACME).json()["data"]
    assert {job["id"] for job in unfiltered} >= {finished_job, compare["id"]}  # an empty filter is none


# -- big jobs, on both databases ---------------------------------------------------------------------------------
def _expected_order(count: int, pending: int, failures_first: bool) -> list[str]:
    def status(position: int) -> str:
        return "pending" if position >= count - pending else status_of(position).value

    positions = list(range(count))
    if failures_first:
        rank = {"failed": 0, "cancelled": 1}
        positions.sort(key=lambda p: (rank.get(status(p), 2), p))
    return [f"r{p}" for p in positions]


def _check_big_job(client: TestClient, job_id: str, count: int) -> None:
    """Pages and exports of a seeded job agree with the order computed here, across page boundaries."""
    for failures_first in (False, True):
        order = "failures_first" if failures_first else "position"
        expected = _expected_order(count, 100, failures_first)
        for offset in (0, 990, count - 30):
            page = _items(client, job_id, order=order, offset=offset, limit=50)
            assert _ids(page) == expected[offset:offset + 50] and page["total"] == count
        exported = client.get(f"/v1/jobs/{job_id}/items/export", params={"order": order}, headers=ACME)
        assert [json.loads(line)["custom_id"] for line in exported.text.splitlines()] == expected
    failed = _items(client, job_id, status="failed", limit=500, offset=100)
    assert failed["total"] == sum(1 for p in range(count - 100) if status_of(p).value == "failed")
    assert _ids(failed) == [f"r{p}" for p in range(count - 100) if status_of(p).value == "failed"][100:600]
    found = _items(client, job_id, q="review 1234")
    assert _ids(found) == ["r1234"] and found["total"] == 1


def _page_ms(client: TestClient, job_id: str, **params: Any) -> float:
    """The best of five requests for one page, in milliseconds."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        _items(client, job_id, **params)
        times.append((time.perf_counter() - start) * 1000)
    return min(times)


def _acme_job(engine: Engine, count: int) -> str:
    return seed_job(engine, count, owner="acme")


def test_big_job_on_sqlite(tmp_path: Path) -> None:
    config = Settings(data_dir=tmp_path / "state", api_keys=KEYS, jobs_poll_interval=0.05)
    url = f"sqlite:///{tmp_path / 'state' / 'inf-engine.db'}"
    upgrade(url)
    engine = create_db_engine(url)
    try:
        small, big = _acme_job(engine, 2_500), _acme_job(engine, 50_000)
    finally:
        engine.dispose()
    with _client(config) as client:
        _check_big_job(client, small, 2_500)
        assert _page_ms(client, big) < 200
        assert _page_ms(client, big, order="failures_first", offset=40_000) < 400


def test_big_job_on_postgres(committed: Engine) -> None:
    small, big = _acme_job(committed, 2_500), _acme_job(committed, 50_000)
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), api_keys=KEYS,
                      jobs_poll_interval=0.05)
    with _client(config) as client:
        _check_big_job(client, small, 2_500)
        assert _page_ms(client, big) < 200
        assert _page_ms(client, big, order="failures_first", offset=40_000) < 400
        # the search (a LIKE over the JSON text) and its 50,000-row count stay within a second
        assert _page_ms(client, big, q="review 4999") < 1000
