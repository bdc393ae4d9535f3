"""``app.client`` (sync and async) against a real server: uvicorn on 127.0.0.1, jobs on PostgreSQL, a scripted LM
behind the pipelines. Two tenants (``acme:sk-acme``, ``globex:sk-globex``) each see only their own resources; the
errors carry the server's OpenAI-style body."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from api.main import create_app
from app.client import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    NotFoundError,
)
from app.client.types import BatchStatus, ItemStatus, JobStatus, RunStatus
from app.jobs.runtime import JobsRuntime
from app.pipeline.resources.types import LLMRequest, LLMResponse
from app.settings import Settings
from tests.support.fakes import ScriptedLM
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend
from tests.support.training import DATASET, GOOD_PROMPT, scripted


def reply(alias: str, request: LLMRequest) -> str:
    return scripted(alias, request) if alias.startswith(("assistant", "optimizer/")) else "ok"


class HangingLM(ScriptedLM):
    """Answers like ``reply``, except that a prompt with "slow" in it waits until it is cancelled."""

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        if "slow" in json.dumps(request.prompt):
            await asyncio.Event().wait()
        return await super().complete(alias, request)


class Tenants:
    def __init__(self, thread: ServerThread) -> None:
        self.url = thread.root
        self.a = Client(thread.root, api_key="sk-acme", timeout=30)
        self.b = Client(thread.base_url, api_key="globex:sk-globex", timeout=30)  # the /v1 form works too

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def server(committed: Engine) -> Iterator[Tenants]:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False),
                      api_keys=["acme:sk-acme", "globex:sk-globex"], jobs_poll_interval=0.05)
    application = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=HangingLM(reply)))
    with ServerThread(application) as thread:
        tenants = Tenants(thread)
        try:
            yield tenants
        finally:
            tenants.close()


def test_a_job_from_submit_to_trace(server: Tenants) -> None:
    client = server.a
    job = client.jobs.submit("sentiment", ["Great phone", "Awful support"], priority=3, metadata={"run": "t"},
                             idempotency_key="once")
    assert job.id.startswith("job_") and job.counts.total == 2 and job.priority == 3 and job.metadata == {"run": "t"}
    replay = client.jobs.submit("sentiment", ["Great phone", "Awful support"], priority=3, metadata={"run": "t"},
                                idempotency_key="once")
    assert replay.id == job.id
    with pytest.raises(ConflictError, match="idempotency key 'once' was already used"):
        client.jobs.submit("sentiment", ["other"], idempotency_key="once")

    results = list(client.jobs.results(job.id, follow=True))
    assert len(results) == 2 and len({r.custom_id for r in results}) == 2
    assert all(r.ok and r.status == ItemStatus.COMPLETED for r in results)
    assert {r.output for r in results} == {"I think this review is positive, overall.",
                                           "I think this review is negative, overall."}
    done = client.jobs.wait(job.id, poll_interval=0.05, timeout=20)
    assert done.status == JobStatus.COMPLETED and done.counts.completed == 2 and done.usage is not None
    assert list(client.jobs.results(job.id, cursor=1)) == results[1:]

    assert [j.id for j in client.jobs.list(status="completed").data] == [job.id]
    assert client.jobs.list(status=["queued", "running"]).data == []
    items = client.jobs.items(job.id, order="position")
    assert items.total == 2 and [row.input for row in items.data] == ["Great phone", "Awful support"]
    exported = client.jobs.export(job.id).decode().splitlines()
    assert [json.loads(line)["input"] for line in exported] == ["Great phone", "Awful support"]
    assert client.jobs.export(job.id, format="csv").startswith(b"custom_id,")
    trace = client.jobs.trace(job.id)
    assert any("LLMInference" in str(event.get("name")) for event in trace["traceEvents"])

    with pytest.raises(ConflictError) as finished:
        client.jobs.cancel(job.id)
    assert finished.value.status_code == 409 and finished.value.code == "job_finished"


async def test_async_client_cancels_a_running_job(server: Tenants) -> None:
    async with AsyncClient(server.url, api_key="acme:sk-acme") as client:
        job = await client.jobs.submit("sentiment", [{"custom_id": "fast", "input": "Great phone"},
                                                     {"custom_id": "slow", "input": "slow review"}])
        seen = []
        async for result in client.jobs.results(job.id, follow=True):
            seen.append(result)
            if result.custom_id == "fast":
                cancelling = await client.jobs.cancel(job.id)
                assert cancelling.status in {JobStatus.CANCELLING, JobStatus.CANCELLED}
        assert [(r.custom_id, r.status) for r in seen] == [("fast", "completed"), ("slow", "cancelled")]
        final = await client.jobs.wait(job.id, poll_interval=0.05, timeout=20)
        assert final.status == JobStatus.CANCELLED and final.counts.cancelled == 1
        assert [j.id for j in (await client.jobs.list()).data] == [job.id]


def test_files_and_batches(server: Tenants) -> None:
    client = server.a
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}} for i in range(2)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.upload(content, filename="requests.jsonl")
    assert uploaded.id.startswith("file-") and uploaded.purpose == "batch" and uploaded.bytes == len(content)
    assert client.files.get(uploaded.id) == uploaded and client.files.content(uploaded.id) == content
    assert [f.id for f in client.files.list(purpose="batch").data] == [uploaded.id]

    batch = client.batches.create(uploaded.id, metadata={"run": "nightly"})
    assert batch.id.startswith("batch_") and batch.request_counts.total == 2 and batch.metadata == {"run": "nightly"}
    for _ in range(400):
        batch = client.batches.get(batch.id)
        if batch.status in {BatchStatus.COMPLETED, BatchStatus.FAILED}:
            break
        time.sleep(0.05)
    assert batch.status == BatchStatus.COMPLETED and batch.output_file_id is not None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).splitlines()]
    assert sorted(row["custom_id"] for row in output) == ["r0", "r1"]
    assert [b.id for b in client.batches.list().data] == [batch.id]
    with pytest.raises(ConflictError, match="only a validating or in-progress batch"):
        client.batches.cancel(batch.id)

    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(NotFoundError):
        client.files.get(uploaded.id)


def test_two_tenants_see_only_their_own(server: Tenants) -> None:
    a, b = server.a, server.b
    a_job = a.jobs.submit("sentiment", ["Great phone"])
    a_file = a.files.upload(b'{"custom_id": "x", "input": "Great"}\n', purpose="user_data", filename="in.jsonl")
    b_job = b.jobs.submit("sentiment", ["Awful"])
    assert [j.id for j in a.jobs.list().data] == [a_job.id]
    assert [j.id for j in b.jobs.list().data] == [b_job.id]
    assert b.files.list().data == [] and [f.id for f in a.files.list().data] == [a_file.id]
    for call in (lambda: b.jobs.get(a_job.id), lambda: b.jobs.cancel(a_job.id), lambda: b.jobs.trace(a_job.id),
                 lambda: list(b.jobs.results(a_job.id)), lambda: b.files.content(a_file.id)):
        with pytest.raises(NotFoundError) as missing:
            call()
        assert missing.value.status_code == 404 and missing.value.body["error"]["message"]
    with pytest.raises(BadRequestError) as foreign:  # nor can b run a job over a's file
        b.jobs.submit("sentiment", input_file_id=a_file.id)
    assert foreign.value.code == "file_not_found"
    assert a.jobs.wait(a_job.id, poll_interval=0.05, timeout=20).status == JobStatus.COMPLETED
    assert b.jobs.wait(b_job.id, poll_interval=0.05, timeout=20).status == JobStatus.COMPLETED


def test_errors_carry_the_body(server: Tenants) -> None:
    with pytest.raises(NotFoundError) as missing:
        server.a.jobs.get("job_nope")
    error = missing.value
    assert error.status_code == 404 and error.response.status_code == 404
    assert set(error.body) == {"error"} and set(error.body["error"]) == {"message", "type", "param", "code"}
    assert error.message == error.body["error"]["message"] and error.message.startswith("no job")
    assert error.param == "job_id" and error.type == "invalid_request_error"

    with pytest.raises(BadRequestError) as bad:
        server.a.jobs.submit("no.such:Pipeline", ["x"])
    assert bad.value.status_code == 400 and "unknown pipeline" in bad.value.message
    assert bad.value.body["error"]["message"] == bad.value.message and bad.value.param == "pipeline"

    with Client(server.url, api_key="sk-wrong") as stranger, pytest.raises(AuthenticationError) as denied:
        stranger.jobs.list()
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    with Client(server.url) as keyless, pytest.raises(AuthenticationError):
        keyless.files.list()

    with Client("http://127.0.0.1:9", timeout=5) as nowhere, pytest.raises(APIConnectionError) as down:
        nowhere.jobs.list()
    assert down.value.status_code is None


def test_trainings_parameters_evaluations_schedules(server: Tenants) -> None:
    client = server.a
    training = client.trainings.create("sentiment", DATASET, metric="exact", epochs=1, batch_size=2, seed=0,
                                       optimizer={"type": "sfa"})
    assert training.id.startswith("train_") and training.progress.total_steps == 2
    trained = client.trainings.wait(training.id, poll_interval=0.05, timeout=60)
    assert trained.status == RunStatus.COMPLETED and trained.final_version == 2 and len(trained.steps or []) == 2
    assert [t.id for t in client.trainings.list().data] == [training.id]

    assert [(p.name, p.active_version) for p in client.pipelines.list().data if p.name == "sentiment"] == [
        ("sentiment", 2)]
    versions = client.pipelines.versions("sentiment")
    assert versions.active_version == 2 and versions.data[1].state["classify.system_prompt"] == GOOD_PROMPT
    diff = client.pipelines.diff("sentiment", 1, 2)
    assert diff.from_ == 1 and diff.to == 2 and [c.name for c in diff.changes] == ["classify.system_prompt"]
    assert client.pipelines.activate("sentiment", 1).active
    assert client.pipelines.version("sentiment", 1).active and not client.pipelines.version("sentiment", 2).active
    for foreign in (lambda: server.b.pipelines.versions("sentiment"),  # the other tenant has no history
                    lambda: server.b.pipelines.activate("sentiment", 1)):
        with pytest.raises(NotFoundError):
            foreign()

    evaluation = client.evaluations.create("sentiment", DATASET, metric="exact", version=2)
    scored = client.evaluations.wait(evaluation.id, poll_interval=0.05, timeout=30)
    assert scored.status == RunStatus.COMPLETED and scored.score == 1.0 and scored.parameter_version == 2
    examples = client.evaluations.examples(evaluation.id, limit=2)
    assert examples.total == len(DATASET) and len(examples.data) == 2 and examples.has_more
    assert [e.id for e in client.evaluations.list().data] == [evaluation.id]

    schedule = client.schedules.create("sentiment", DATASET, cron="0 3 * * *", margin=0.05,
                                       loss={"type": "verifier", "check": "contains"})
    assert schedule.cron == "0 3 * * *" and schedule.enabled and schedule.loss["check"] == "contains"
    assert client.schedules.get(schedule.id) == schedule
    assert [s.id for s in client.schedules.list().data] == [schedule.id]
    assert client.schedules.runs(schedule.id).data == []
    assert not client.schedules.pause(schedule.id).enabled and client.schedules.resume(schedule.id).enabled
    assert server.b.schedules.list().data == []
    assert client.feedback.pending().data == []
