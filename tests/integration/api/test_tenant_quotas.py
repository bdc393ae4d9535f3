"""Per-tenant quotas through the HTTP API on PostgreSQL: a tenant over ``tenant_max_queued_items`` gets 429 (an
OpenAI error body, ``Retry-After``) for jobs and batches while other tenants go on; ``tenant_quotas`` overrides
the default; ``/metrics`` shows each tenant's queued and running items. The servers here run no jobs
(``run_executor=False``), so what is submitted stays queued."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import Engine, func, select, update
from typer.testing import CliRunner

from api.main import create_app
from app.cli import app as cli
from app.db import Item, ItemStatus, Job
from app.jobs.runtime import JobsRuntime
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend

KEYS = ["acme:sk-1", "beta:sk-2", "gamma:sk-3"]
ACME, BETA, GAMMA = ("sk-1", "sk-2", "sk-3")
LIMIT = 5  # tenant_max_queued_items; gamma's override is 8


def _items(count: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"custom_id": f"{prefix}{i}", "input": {"review": f"review {i}"}} for i in range(count)]


def _batch_lines(count: int) -> bytes:
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}} for i in range(count)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


class Api:
    def __init__(self, thread: ServerThread, engine: Engine) -> None:
        self.thread = thread
        self.engine = engine
        self.http = httpx.Client(base_url=thread.root, timeout=30)

    def submit(self, key: str, count: int, prefix: str = "r", **body: Any) -> httpx.Response:
        return self.http.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                              json={"pipeline": "review-compare", "inputs": _items(count, prefix), **body})

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(api_key=key, base_url=self.thread.base_url, max_retries=0, timeout=30)

    def jobs_of(self, tenant: str) -> int:
        with self.engine.connect() as connection:
            return int(connection.scalar(select(func.count()).select_from(Job).where(Job.owner == tenant)) or 0)

    def gauges(self) -> dict[tuple[str, str], float]:
        text = self.http.get("/metrics").text
        found = re.findall(r'^inf_engine_tenant_(queued|running)_items\{tenant="([^"]+)"\} (\S+)$', text, re.M)
        return {(tenant, kind): float(value) for kind, tenant, value in found}


def _serve(engine_url: str, engine: Engine, **settings: Any) -> Iterator[Api]:
    config = Settings(database_url=engine_url, api_keys=KEYS, jobs_poll_interval=0.05, **settings)
    runtime = JobsRuntime(config, resources=ScriptedLM(), run_executor=False)
    with ServerThread(create_app(config, backend=FakeBackend(), jobs=runtime)) as thread:
        api = Api(thread, engine)
        try:
            yield api
        finally:
            api.http.close()


@pytest.fixture
def api(committed: Engine) -> Iterator[Api]:
    url = committed.url.render_as_string(hide_password=False)
    yield from _serve(url, committed, tenant_max_queued_items=LIMIT,
                      tenant_quotas={"gamma": {"max_queued_items": 8}})


def test_a_tenant_over_its_quota_gets_429_and_others_go_on(api: Api) -> None:
    assert api.submit(ACME, 3).status_code == 201
    refused = api.submit(ACME, 3, prefix="s")
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "5"
    error = refused.json()["error"]
    assert error["type"] == "quota_exceeded" and error["code"] == "tenant_max_queued_items"
    assert error["param"] is None
    assert error["message"] == (
        "tenant acme has 3 items queued or running; this job adds 3; the limit is 5 "
        "(INF_ENGINE_TENANT_MAX_QUEUED_ITEMS): wait for some of its jobs to finish (or cancel some), or ask the "
        "operator to raise the limit"
    )
    assert api.jobs_of("acme") == 1  # the refused job wrote nothing
    assert api.submit(ACME, 2, prefix="t").status_code == 201  # exactly up to the limit
    assert api.submit(BETA, 5).status_code == 201  # another tenant has its own count
    too_big = api.submit(BETA, 6, prefix="u")
    assert too_big.status_code == 429 and "split it into jobs of at most 5 items" in too_big.json()["error"]["message"]


def test_the_per_tenant_override_and_an_idempotent_replay(api: Api) -> None:
    assert api.submit(GAMMA, 8, idempotency_key="k-1").status_code == 201  # over the default 5, within its 8
    replay = api.submit(GAMMA, 8, idempotency_key="k-1")  # the same job back: never refused
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    refused = api.submit(GAMMA, 1, prefix="x")
    assert refused.status_code == 429
    assert "the limit is 8 (INF_ENGINE_TENANT_QUOTAS, gamma.max_queued_items)" in refused.json()["error"]["message"]


def test_finished_items_free_the_quota(api: Api) -> None:
    job = api.submit(ACME, 5).json()
    assert api.submit(ACME, 1, prefix="y").status_code == 429
    assert api.http.post(f"/v1/jobs/{job['id']}/cancel", headers={"Authorization": f"Bearer {ACME}"}).is_success
    with api.engine.begin() as connection:  # what the executor would do (none runs here): the job ends
        connection.execute(update(Item).where(Item.job_id == job["id"]).values(status=ItemStatus.CANCELLED))
        connection.execute(update(Job).where(Job.id == job["id"]).values(status="cancelled", cancelled_items=5))
    assert api.submit(ACME, 5, prefix="z").status_code == 201


def test_concurrent_submissions_cannot_both_pass(api: Api) -> None:
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda n: api.submit(ACME, 2, prefix=f"c{n}-").status_code, range(8)))
    assert sorted(statuses) == [201, 201] + [429] * 6, statuses
    assert api.jobs_of("acme") == 2


def test_concurrent_twins_of_one_idempotency_key_get_the_same_job(api: Api) -> None:
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: api.submit(ACME, 5, idempotency_key="twin"), range(6)))
    assert [a.status_code for a in answers] == [201] * 6, [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1 and api.jobs_of("acme") == 1


def test_batches_over_quota_and_the_openai_client(api: Api) -> None:
    client = api.openai(ACME)
    requests = client.files.create(file=("requests.jsonl", _batch_lines(4)), purpose="batch")
    first = client.batches.create(input_file_id=requests.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert first.status in {"validating", "in_progress"}
    with pytest.raises(openai.RateLimitError) as caught:
        client.batches.create(input_file_id=requests.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert caught.value.status_code == 429 and caught.value.code == "tenant_max_queued_items"
    assert caught.value.type == "quota_exceeded"
    assert "tenant acme has 4 items queued or running; this job adds 4; the limit is 5" in caught.value.message
    assert caught.value.response.headers["retry-after"] == "5"
    assert len(client.batches.list().data) == 1  # the refused batch was not stored
    other = api.openai(BETA)
    theirs = other.files.create(file=("requests.jsonl", _batch_lines(4)), purpose="batch")
    assert other.batches.create(input_file_id=theirs.id, endpoint="/v1/chat/completions",
                                completion_window="24h").id
    client.close()
    other.close()


def test_cli_submit_over_quota_is_one_line_and_exit_2(api: Api, tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in _items(6)))
    result = CliRunner().invoke(cli, ["submit", "review-compare", "--input", str(path), "--url", api.thread.root,
                                      "--api-key", ACME])
    assert result.exit_code == 2, result.output
    assert "HTTP 429: tenant acme has 0 items queued or running; this job adds 6; the limit is 5" in result.output
    assert "Traceback" not in result.output


def test_metrics_show_each_tenants_queued_and_running_items(api: Api) -> None:
    assert api.gauges()[("acme", "queued")] == 0  # configured tenants are shown while idle
    acme = api.submit(ACME, 4).json()
    assert api.submit(BETA, 3).status_code == 201
    with api.engine.begin() as connection:  # two of acme's items start (as a worker would mark them)
        first_two = select(Item.id).where(Item.job_id == acme["id"]).order_by(Item.position).limit(2)
        connection.execute(update(Item).where(Item.id.in_(first_two))
                           .values(status=ItemStatus.RUNNING))
    gauges = api.gauges()
    assert gauges[("acme", "queued")] == 2 and gauges[("acme", "running")] == 2
    assert gauges[("beta", "queued")] == 3 and gauges[("beta", "running")] == 0
    assert gauges[("gamma", "queued")] == 0 and gauges[("gamma", "running")] == 0
    assert api.submit(ACME, 2, prefix="m").status_code == 429  # running items count against the quota too


def test_sqlite_embedded_mode_enforces_and_reports(tmp_path: Path) -> None:
    config = Settings(data_dir=tmp_path / "state", tenant_max_queued_items=3, jobs_poll_interval=0.05)
    runtime = JobsRuntime(config, resources=ScriptedLM(), run_executor=False)
    with ServerThread(create_app(config, backend=FakeBackend(), jobs=runtime)) as thread, \
            httpx.Client(base_url=thread.root) as http:
        body = {"pipeline": "review-compare", "inputs": _items(3)}
        assert http.post("/v1/jobs", json=body).status_code == 201
        refused = http.post("/v1/jobs", json=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_max_queued_items"
        assert 'inf_engine_tenant_queued_items{tenant="anonymous"} 3.0' in http.get("/metrics").text
