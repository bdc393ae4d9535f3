"""What the console's browser tests share: the server under test with two tenants' keys and a scripted LLM behind
the jobs (the shipped ``sentiment`` pipeline), signing in, and data made through the public API as a user would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx

from api.main import create_app
from app.db import create_db_engine, make_session_factory, session_scope, utcnow
from app.db.migrate import upgrade
from app.jobs.learning.evaluations import fire_due_schedules
from app.jobs.runtime import JobsRuntime
from app.pipeline.resources.types import LLMRequest
from app.settings import Settings
from tests.support.browser import Browser, chromium, require_browser
from tests.support.fakes import ScriptedLM
from tests.support.postgres import temporary_database
from tests.support.server_helpers import ServerThread
from tests.support.serving_fakes import FakeBackend
from tests.support.training import DATASET, scripted

ACME, GLOBEX = "sk-console-acme", "sk-console-globex"
TERMINAL = {"completed", "failed", "cancelled"}


def console_reply(alias: str, request: LLMRequest) -> str:
    """The training tests' scripted classifier, except that a review mentioning 'explode' fails its call."""
    if "explode" in str(request.prompt):
        raise ValueError("the scripted model refuses this review")
    if alias not in ("assistant", "optimizer/updater", "optimizer/aggregator"):  # the Batch API's model
        return f"echo: {request.prompt}"
    return scripted(alias, request)


@dataclass
class Console:
    """The running server and one API client per tenant."""

    root: str
    url: str
    acme: httpx.Client
    globex: httpx.Client
    made: dict[str, Any] = field(default_factory=dict)  # what the tests share (ids), made once

    def wait(self, client: httpx.Client, path: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = client.get(path).json()
            if view.get("status") in TERMINAL:
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not finish: {view}")
            time.sleep(0.05)

    def browser(self, key: str | None = ACME, **size: int) -> Any:
        return signed_in(self.root, key, **size)


@contextmanager
def signed_in(root: str, key: str | None, **size: int) -> Iterator[Browser]:
    """A browser on the console, signed in with ``key`` (None: not signed in)."""
    with chromium(root, **size) as browser:
        if key is not None:
            sign_in(browser, key)
        yield browser


def sign_in(browser: Browser, key: str) -> None:
    browser.open("/console")
    field_ = browser.wait_for("#api-key")
    field_.send_keys(key)
    browser.css("#sign-in").click()
    browser.wait_for("[data-testid=nav]")


def serve_console() -> Iterator[Console]:
    """The server under test and a client per tenant (a generator: the fixture yields from it)."""
    require_browser()
    with temporary_database("infe_console") as url:
        upgrade(url)
        # two calls at a time: a job of a few dozen items runs for seconds, so its progress can be seen moving
        config = Settings(database_url=url, api_keys=[f"acme:{ACME}", f"globex:{GLOBEX}"],
                          jobs_poll_interval=0.05, default_max_concurrent=2)
        lm = ScriptedLM(console_reply, latency=0.15)
        app = create_app(config, jobs=JobsRuntime(config, resources=lm), backend=_backend())
        with ServerThread(app) as server:
            clients = [httpx.Client(base_url=server.root, timeout=60, headers={"Authorization": f"Bearer {key}"})
                       for key in (ACME, GLOBEX)]
            try:
                yield Console(server.root, url, clients[0], clients[1])
            finally:
                for client in clients:
                    client.close()


def _backend() -> Any:
    return FakeBackend()


# -- data made through the API -----------------------------------------------------------------------------------
def submit_job(console: Console, reviews: list[str], client: httpx.Client | None = None) -> str:
    reply = (client or console.acme).post("/v1/jobs", json={"pipeline": "sentiment", "inputs": reviews})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["id"])


def trained(console: Console) -> dict[str, Any]:
    """A finished training of ``sentiment`` (version 1 → 2) and one evaluation of each version; made once."""
    if "training" not in console.made:
        created = console.acme.post("/v1/trainings", json={"pipeline": "sentiment", "dataset": DATASET,
                                                             "metric": "exact", "batch_size": 4})
        assert created.status_code == 201, created.text
        training = console.wait(console.acme, f"/v1/trainings/{created.json()['id']}")
        assert training["status"] == "completed", training
        evaluations = []
        for version in (1, 2):
            made = console.acme.post("/v1/evaluations", json={"pipeline": "sentiment", "dataset": DATASET,
                                                                "metric": "exact", "version": version})
            assert made.status_code == 201, made.text
            evaluations.append(console.wait(console.acme, f"/v1/evaluations/{made.json()['id']}"))
        console.made.update(training=training, evaluations=evaluations)
    return console.made


def schedule_with_regression(console: Console) -> dict[str, Any]:
    """A daily schedule with three runs: version 2 (score 1), version 2 again, then version 1 (score 0): the
    third run regressed. Each run is fired by the beat's own function and run by the server."""
    trained(console)
    if "schedule" not in console.made:
        made = console.acme.post("/v1/evaluations/schedules", json={
            "pipeline": "sentiment", "dataset": DATASET, "metric": "exact", "cron": "@daily", "margin": 0.1})
        assert made.status_code == 201, made.text
        schedule = made.json()
        engine = create_db_engine(console.url)
        sessions = make_session_factory(engine)
        try:
            for day, version in enumerate((2, 2, 1), start=1):
                activated = console.acme.post(f"/v1/pipelines/sentiment/parameters/versions/{version}/activate")
                assert activated.status_code == 200, activated.text
                with session_scope(sessions) as session:
                    (run_id,) = fire_due_schedules(session, now=utcnow() + timedelta(days=day))
                console.acme.get("/v1/evaluations")  # wakes the server's executor
                console.wait(console.acme, f"/v1/evaluations/{run_id}")
        finally:
            engine.dispose()
        console.acme.post("/v1/pipelines/sentiment/parameters/versions/2/activate")
        console.made["schedule"] = schedule
    return console.made
