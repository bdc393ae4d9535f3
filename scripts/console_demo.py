"""The browser console with data to look at: the real server (uvicorn on 127.0.0.1, SQLite in a temporary data
directory) with a scripted LLM behind the jobs, seeded through the public HTTP API as a user would.

    .venv/bin/python scripts/console_demo.py [--port 8765] [--keys] [--items 400] [--exit-after-seed]

What it makes (for the shipped ``sentiment`` pipeline): a job of ``--items`` reviews in which every review that
mentions "explode" fails (the scripted model raises), a few small jobs (one cancelled), a training (version 1 → 2),
an evaluation of each version, a daily schedule fired five times by the beat's own function with the active
version switched between fires (the fourth run regressed), an OpenAI Batch with its input, output and error
files, and last a job of ``--live`` items left running, to watch its progress. With ``--keys`` the server has
two tenants' keys (printed); the data belongs to the first, and the second gets one job of its own. Ctrl-C stops the server; ``--exit-after-seed`` stops it once the data is made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from api.main import create_app  # noqa: E402
from app.db import utcnow  # noqa: E402
from app.jobs.learning.evaluations import fire_due_schedules  # noqa: E402
from app.jobs.runtime import JobsRuntime  # noqa: E402
from app.pipeline.resources.types import LLMRequest, LLMResponse  # noqa: E402
from app.settings import Settings  # noqa: E402
from tests.support.fakes import ScriptedLM  # noqa: E402
from tests.support.serving_fakes import FakeBackend  # noqa: E402
from tests.support.training import DATASET, scripted  # noqa: E402

KEYS = {"acme": "sk-demo-acme", "globex": "sk-demo-globex"}
TERMINAL = {"completed", "failed", "cancelled", "expired"}
# the evaluations' examples: the training's four, and six more, two of them labelled against what the scripted
# classifier answers (so even the trained version misses some)
EVAL_SET = [*DATASET,
            {"input": "Lovely colours, solid build", "target": "positive"},
            {"input": "Stopped charging, awful", "target": "negative"},
            {"input": "Great price and fast delivery", "target": "positive"},
            {"input": "Never buying this brand again", "target": "negative"},
            {"input": "Great idea, terrible execution", "target": "negative"},
            {"input": "Not bad at all, I like it", "target": "positive"}]
WORDS = ("Great", "Lovely", "Broke", "Awful", "solid", "battery", "screen", "support", "delivery", "price", "case",
         "camera", "speaker", "charger", "cable", "manual", "refund", "colour", "weight", "sound")


def demo_reply(alias: str, request: LLMRequest) -> str:
    """The training tests' scripted classifier, except that a review mentioning 'explode' fails its call; the
    Batch API's requests (alias ``batch``) are greeted, and three of them fail."""
    if "explode" in str(request.prompt):
        raise ValueError("the scripted model refuses this review (it mentions 'explode')")
    if alias == "batch":  # the Batch API's chat completions: one request in four fails
        if "#3" in str(request.prompt) or "#7" in str(request.prompt) or "#11" in str(request.prompt):
            raise ValueError("the scripted model does not greet odd numbers ending in 3, 7 or 11")
        return "Hello! " + str(request.prompt)[-40:]
    return scripted(alias, request)


class DemoLM(ScriptedLM):
    """The scripted LM with calls of varied length (10-100% of ``latency``, 15 times that for the job left
    running), so the trace waterfall has some shape."""

    def __init__(self, latency: float) -> None:
        super().__init__(demo_reply)
        self.scale = latency

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        slow = 15 if "(live)" in str(request.prompt) else 1  # the job left running moves slowly enough to watch
        await asyncio.sleep(random.uniform(0.1, 1.0) * self.scale * slow)
        return await super().complete(alias, request)


class Server:
    """uvicorn serving ``app`` on 127.0.0.1:``port`` in a background thread."""

    def __init__(self, app: Any, port: int) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise SystemExit("the server did not start (is the port taken?)")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# -- seeding through the API -------------------------------------------------------------------------------------
def check(reply: httpx.Response, *codes: int) -> dict[str, Any]:
    if reply.status_code not in (codes or (200, 201)):
        raise SystemExit(f"{reply.request.method} {reply.request.url.path} answered {reply.status_code}: "
                         f"{reply.text[:500]}")
    body: dict[str, Any] = reply.json()
    return body


def wait(client: httpx.Client, path: str, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view = check(client.get(path))
        if view.get("status") in TERMINAL:
            return view
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not finish in {timeout:.0f} s: {view.get('status')}")
        time.sleep(0.1)


def reviews(count: int, rng: random.Random, tag: str = "") -> list[str]:
    out = []
    for i in range(count):
        words = rng.sample(WORDS, k=rng.randint(3, 9))
        text = " ".join(words) + f" (review {i + 1}){tag}"
        if i % 11 == 7:
            text += " - it made the charger explode"
        if i % 37 == 5:
            text += " " + "and a very long digression about the packaging, " * 6
        out.append(text)
    return out


def submit(client: httpx.Client, inputs: list[Any], **extra: Any) -> str:
    return str(check(client.post("/v1/jobs", json={"pipeline": "sentiment", "inputs": inputs, **extra}), 201)["id"])


def upload(client: httpx.Client, name: str, lines: list[dict[str, Any]], purpose: str) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    view = check(client.post("/v1/files", files={"file": (name, content, "application/jsonl")},
                             data={"purpose": purpose}))
    return str(view["id"])


def seed(client: httpx.Client, runtime: JobsRuntime, items: int, other: httpx.Client | None,
         live: int = 0) -> dict[str, Any]:
    rng = random.Random(30)
    made: dict[str, Any] = {}
    say("jobs")
    small = [submit(client, ["Great phone, I love it", "Awful support, never again"]),
             submit(client, ["Lovely screen and great battery"], metadata={"team": "demo"}),
             submit(client, ["Broke after a day, awful", "it made the charger explode"])]
    slow = submit(client, reviews(60, rng), priority=5)
    check(client.post(f"/v1/jobs/{slow}/cancel"))
    big = submit(client, reviews(items, rng))
    made["jobs"] = [big, *small, slow]
    if other is not None:
        made["other_tenant_job"] = submit(other, ["Globex only: great price"])

    say("training (version 1 -> 2)")
    training = check(client.post("/v1/trainings", json={"pipeline": "sentiment", "dataset": DATASET,
                                                        "metric": "exact", "batch_size": 2}), 201)
    made["training"] = wait(client, f"/v1/trainings/{training['id']}")["id"]

    say("evaluations of version 1 and version 2")
    made["evaluations"] = []
    for version in (1, 2):
        evaluation = check(client.post("/v1/evaluations", json={"pipeline": "sentiment", "dataset": EVAL_SET,
                                                                "metric": "exact", "version": version}), 201)
        made["evaluations"].append(wait(client, f"/v1/evaluations/{evaluation['id']}")["id"])

    say("a schedule fired five times (the fourth run regresses)")
    schedule = check(client.post("/v1/evaluations/schedules", json={
        "pipeline": "sentiment", "dataset": EVAL_SET, "metric": "exact", "cron": "@daily", "margin": 0.1}), 201)
    made["schedule"] = schedule["id"]
    for day, version in enumerate((1, 2, 2, 1, 2), start=1):
        check(client.post(f"/v1/pipelines/sentiment/parameters/versions/{version}/activate"))
        with runtime.session() as session:
            fired = fire_due_schedules(session, now=utcnow() + timedelta(days=day))
        client.get("/v1/evaluations")  # the learning executor polls; this only makes sure it has started
        for run_id in fired:
            wait(client, f"/v1/evaluations/{run_id}")
    check(client.post("/v1/pipelines/sentiment/parameters/versions/2/activate"))

    say("a batch")
    lines = [{"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "demo", "messages": [{"role": "user", "content": f"Say hello #{i}"}]}}
             for i in range(12)]
    batch_file = upload(client, "greetings.jsonl", lines, "batch")
    batch = check(client.post("/v1/batches", json={"input_file_id": batch_file, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h", "metadata": {"demo": "yes"}}))
    made["batch"] = wait(client, f"/v1/batches/{batch['id']}")["id"]
    upload(client, "reviews.jsonl", [{"custom_id": f"r{i}", "input": text} for i, text in
                                     enumerate(reviews(20, rng))], "user_data")

    say("waiting for the big job")
    wait(client, f"/v1/jobs/{big}")
    if live:
        made["live_job"] = submit(client, reviews(live, rng, " (live)"), metadata={"note": "still running"})
    return made


def say(what: str) -> None:
    print(f"  seeding: {what}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--keys", action="store_true", help="two tenants with API keys (else an open server)")
    parser.add_argument("--items", type=int, default=400, help="items of the big job")
    parser.add_argument("--live", type=int, default=4000,
                        help="items of a last job left running when the seeding ends (0: none)")
    parser.add_argument("--latency", type=float, default=0.15, help="the longest scripted LLM call, in seconds")
    parser.add_argument("--data-dir", type=Path, help="keep the server's state here (default: a temporary folder)")
    parser.add_argument("--exit-after-seed", "--seed-only", dest="exit_after_seed", action="store_true",
                        help="stop once the data is made")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="console-demo-") as scratch:
        data_dir = args.data_dir or Path(scratch) / "state"
        keys = [f"{tenant}:{key}" for tenant, key in KEYS.items()] if args.keys else []
        config = Settings(data_dir=data_dir, jobs_poll_interval=0.05, api_keys=keys)
        runtime = JobsRuntime(config, resources=DemoLM(args.latency))
        app = create_app(config, backend=FakeBackend(), jobs=runtime)
        root = f"http://127.0.0.1:{args.port}"
        with Server(app, args.port):
            print(f"server at {root} (data in {data_dir})", flush=True)
            headers = {"Authorization": f"Bearer {KEYS['acme']}"} if args.keys else {}
            other_headers = {"Authorization": f"Bearer {KEYS['globex']}"}
            with httpx.Client(base_url=root, timeout=60, headers=headers) as client, \
                    httpx.Client(base_url=root, timeout=60, headers=other_headers) as other:
                started = time.monotonic()
                made = seed(client, runtime, args.items, other if args.keys else None,
                            0 if args.exit_after_seed else args.live)
                print(f"seeded in {time.monotonic() - started:.1f} s: {json.dumps(made)}", flush=True)
            print(f"\nconsole: {root}/console", flush=True)
            if args.keys:
                print(f"API keys: {KEYS['acme']} (tenant acme, has the data), {KEYS['globex']} (tenant globex)")
            if args.exit_after_seed:
                return 0
            print("Ctrl-C stops the server.", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print("stopping", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
