"""Benchmark: is the platform fair between tenants? A small job's latency while another tenant's big job runs.

The setup of issue 28, as a team runs it: PostgreSQL, Redis, ``inf-engine serve`` (the real API, two tenants'
keys), one ``inf-engine worker --queues cpu,llm --pool threads --concurrency 32`` and ``inf-engine beat``; every
alias goes to a loopback OpenAI-compatible server (its own process) answering in 50 ms, with
``max_concurrent = 8``. Tenant A submits a big job of the ``sentiment`` example (one call an item); tenant B
submits 10 items two seconds later at the same priority. Printed side by side, in one run:

* B alone; B while A runs 3,000 items (and 20,000), on workers and embedded (the server's own executor, no Redis);
* A's makespan with the fair, bounded dispatch and with today's FIFO dispatch (``INF_ENGINE_DISPATCH_WINDOW``
  large enough to send the whole job at once, as before);
* the peak of messages waiting in Redis while A runs, against the window;
* a 50,000-item job: seconds from submit to its first result, and from cancel to cancelled.

    .venv/bin/python scripts/bench_fairness.py                      # everything (about 10 minutes)
    .venv/bin/python scripts/bench_fairness.py --big 1000 --huge 0 --cancel-items 5000   # a quick check

Needs PostgreSQL (``--postgres``: a scratch database per platform, dropped at the end) and Redis (``--redis``;
keys under a scratch prefix, deleted at the end).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from redis import Redis  # noqa: E402

from scripts.bench_platform import fake_server, scratch_database  # noqa: E402

KEYS = {"A": "acme:sk-acme", "B": "beta:sk-beta"}
FIFO_WINDOW = 10_000_000  # a window no job fills: every ready node is sent at once, as before the window


@dataclass
class Result:
    mode: str
    a_items: int
    b_alone_s: float | None = None
    b_s: float | None = None
    a_s: float | None = None
    peak: int | None = None
    window: str = ""

    @property
    def bound_s(self) -> float | None:
        return None if self.b_alone_s is None else 3 * self.b_alone_s + 2


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Platform:
    """``serve`` (+ ``worker`` and ``beat`` with Redis) on a scratch database; ``close()`` stops them."""

    def __init__(self, db_url: str, redis_url: str | None, base_url: str, tmp: Path, args: argparse.Namespace,
                 window: int = 0) -> None:
        self.prefix = f"fair{uuid.uuid4().hex[:8]}"
        self.redis_url = redis_url
        resources = tmp / f"resources-{self.prefix}.toml"
        resources.write_text(
            f'[endpoints.assistant]\nprovider = "openai"\nmodel = "bench"\nbase_url = "{base_url}"\n'
            f'api_key = "sk-bench"\nmax_concurrent = {args.max_concurrent}\n'
        )
        self.port = free_port()
        self.env = {
            **os.environ,
            "INF_ENGINE_DATABASE_URL": db_url,
            "INF_ENGINE_RESOURCES_FILE": str(resources),
            "INF_ENGINE_DATA_DIR": str(tmp / f"data-{self.prefix}"),
            "INF_ENGINE_LOG_LEVEL": "WARNING",
            "INF_ENGINE_API_KEYS": ",".join(KEYS.values()),
            "INF_ENGINE_BACKEND": "openai",
            "INF_ENGINE_OPENAI_BASE_URL": base_url,
            "INF_ENGINE_JOBS_POLL_INTERVAL": "0.2",
            "INF_ENGINE_SWEEP_INTERVAL": "2",
            "INF_ENGINE_DISPATCH_WINDOW": str(window),
            "PYTHONPATH": str(ROOT),
        }
        self.env.pop("INF_ENGINE_REDIS_URL", None)
        if redis_url:
            self.env.update(INF_ENGINE_REDIS_URL=redis_url, INF_ENGINE_REDIS_PREFIX=self.prefix,
                            INF_ENGINE_CELERY_QUEUE_PREFIX=self.prefix)
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self._start("serve", "--host", "127.0.0.1", "--port", str(self.port))
        if redis_url:
            self._start("worker", "--queues", "cpu,llm", "--pool", "threads", "--concurrency", str(args.threads),
                        "--name", f"fair.{self.prefix}@localhost")
            self._start("beat")
        self._wait_ready()

    def _start(self, *argv: str) -> None:
        log = (self.tmp / f"{argv[0]}-{self.prefix}.log").open("wb")
        self.procs.append(subprocess.Popen([sys.executable, "-m", "app.cli", *argv], cwd=ROOT, env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = self.http.get("/health").json()
                workers = health.get("platform", {}).get("workers", 1) if self.redis_url else 1
                if workers:
                    # one tiny job end to end: the database, the workers and the endpoint all answer
                    self.run_job("B", 1)
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the platform did not start; see {self.tmp}/*-{self.prefix}.log")

    def submit(self, tenant: str, items: int) -> str:
        inputs = [{"custom_id": f"{tenant}-{i}", "input": f"review {i}: the battery lasts"} for i in range(items)]
        reply = self.http.post("/v1/jobs", json={"pipeline": "sentiment", "inputs": inputs},
                               headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        reply.raise_for_status()
        return str(reply.json()["id"])

    def view(self, tenant: str, job_id: str) -> dict[str, Any]:
        reply = self.http.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        reply.raise_for_status()
        return dict(reply.json())

    def wait(self, tenant: str, job_id: str, start: float, timeout: float = 3600) -> float:
        while time.monotonic() - start < timeout:
            view = self.view(tenant, job_id)
            if view["status"] in ("completed", "failed", "cancelled"):
                if view["status"] != "completed":
                    raise RuntimeError(f"job {job_id} ended {view['status']}: {view.get('error')}")
                return time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(f"job {job_id} did not finish in {timeout} s")

    def run_job(self, tenant: str, items: int) -> float:
        start = time.monotonic()
        return self.wait(tenant, self.submit(tenant, items), start)

    def first_result_s(self, tenant: str, job_id: str, start: float) -> float:
        while True:
            if self.view(tenant, job_id)["counts"]["completed"] > 0:
                return time.monotonic() - start
            time.sleep(0.05)

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        self.http.close()
        if self.redis_url:
            with Redis.from_url(self.redis_url) as redis:
                keys = list(redis.scan_iter(match=f"{self.prefix}*", count=1000))
                if keys:
                    redis.delete(*keys)


@contextmanager
def redis_peak(platform: Platform) -> Iterator[list[int]]:
    """Samples the messages waiting in the llm queue (every priority list) every 20 ms."""
    peak = [0]
    stop = threading.Event()
    if platform.redis_url is None:
        yield peak
        return
    keys = [f"{platform.prefix}:celery:{platform.prefix}.llm"]  # the nodes' queue (beat's tasks go to cpu)
    keys = [k if level == 0 else f"{k}:{level}" for k in keys for level in range(10)]

    def sample() -> None:
        with Redis.from_url(platform.redis_url or "") as redis:
            while not stop.is_set():
                with redis.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.llen(key)
                    peak[0] = max(peak[0], sum(int(n) for n in pipe.execute()))
                stop.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def contended(platform: Platform, mode: str, a_items: int, b_alone: float, window: str) -> Result:
    print(f"... {mode}: A {a_items:,} items, B 10", file=sys.stderr, flush=True)
    """A submits ``a_items``; B submits 10 items two seconds later; both timed from their own submit."""
    with redis_peak(platform) as peak:
        a_start = time.monotonic()
        a_job = platform.submit("A", a_items)
        time.sleep(2.0)
        b_s = platform.run_job("B", 10)
        a_s = platform.wait("A", a_job, a_start)
    return Result(mode, a_items, b_alone, b_s, a_s, peak[0] if platform.redis_url else None, window)


def huge_job(platform: Platform, items: int) -> tuple[float, float, float]:
    """Seconds the submit (the POST) took, from its answer to the job's first result, and from the job's cancel
    to ``cancelled``."""
    start = time.monotonic()
    job_id = platform.submit("A", items)
    posted = time.monotonic() - start
    first = platform.first_result_s("A", job_id, time.monotonic())
    time.sleep(2.0)
    cancel_start = time.monotonic()
    platform.http.post(f"/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {KEYS['A']}"})
    while platform.view("A", job_id)["status"] != "cancelled":
        time.sleep(0.05)
    return posted, first, time.monotonic() - cancel_start


def fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.2f} {unit}" if unit else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", default=os.environ.get("INF_ENGINE_TEST_POSTGRES",
                                                             "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--big", type=int, default=3000, help="A's items (0: skip)")
    parser.add_argument("--huge", type=int, default=20000, help="A's items in the larger run (0: skip)")
    parser.add_argument("--cancel-items", type=int, default=50000, help="the job cancelled (0: skip)")
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs of A's makespan on each dispatch, interleaved")
    parser.add_argument("--only-makespan", action="store_true", help="just A's makespan, fair against FIFO")
    args = parser.parse_args()
    rows: list[Result] = []
    extra: list[str] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fairness-")))
        base_url = stack.enter_context(fake_server(args.latency_ms / 1000))

        def platform(redis: bool, window: int = 0) -> Platform:
            db = stack.enter_context(scratch_database(args.postgres))
            made = Platform(db, args.redis if redis else None, base_url, tmp, args, window)
            stack.callback(made.close)
            return made

        fair = platform(True)
        b_alone = min(fair.run_job("B", 10) for _ in range(3))
        window = f"auto (llm cap {2 * args.max_concurrent})"
        if args.big:
            fifo = platform(True, FIFO_WINDOW)
            fifo_alone = min(fifo.run_job("B", 10) for _ in range(3))
            for _ in range(args.repeats):  # interleaved: both see the same drift of this host
                rows.append(contended(fair, "workers, fair", args.big, b_alone, window))
                rows.append(contended(fifo, "workers, FIFO (before)", args.big, fifo_alone, "none"))
        if args.only_makespan:
            args.huge = args.cancel_items = 0
        if args.huge:
            rows.append(contended(fair, "workers, fair", args.huge, b_alone, window))
        if not args.only_makespan:
            embedded = platform(False)
            e_alone = min(embedded.run_job("B", 10) for _ in range(3))
            for items in (args.big, args.huge):
                if items:
                    rows.append(contended(embedded, "embedded", items, e_alone, "-"))
        if args.cancel_items:
            with redis_peak(fair) as peak:
                posted, first, cancel = huge_job(fair, args.cancel_items)
            extra.append(f"{args.cancel_items:,}-item job on workers: POST /v1/jobs {posted:.2f} s; first result "
                         f"{first:.2f} s after it answered ({posted + first:.2f} s from the request); cancelled "
                         f"{cancel:.2f} s after the cancel; Redis peak {peak[0]} messages")
    print(f"\nsentiment, {args.latency_ms:g} ms a call, max_concurrent {args.max_concurrent}, worker threads "
          f"{args.threads}; B = 10 items submitted 2 s after A, same priority; bound = 3 x B alone + 2 s\n")
    header = f"{'mode':<24}{'A items':>9}{'B alone':>10}{'B with A':>10}{'bound':>9}{'A makespan':>12}" \
             f"{'Redis peak':>12}  window"
    print(header)
    print("-" * len(header))
    for r in rows:
        ok = "" if r.b_s is None or r.bound_s is None else (" ok" if r.b_s <= r.bound_s else " OVER")
        print(f"{r.mode:<24}{r.a_items:>9,}{fmt(r.b_alone_s):>10}{fmt(r.b_s):>10}{fmt(r.bound_s):>9}"
              f"{fmt(r.a_s):>12}{fmt(r.peak, ''):>12}  {r.window}{ok}")
    fair_s = [r.a_s for r in rows if r.mode == "workers, fair" and r.a_items == args.big and r.a_s]
    fifo_s = [r.a_s for r in rows if r.mode.startswith("workers, FIFO") and r.a_s]
    if fair_s and fifo_s:
        print(f"\nA's makespan ({args.big:,} items), best of {len(fair_s)} interleaved runs: fair {min(fair_s):.2f} s, "
              f"FIFO {min(fifo_s):.2f} s, fair / FIFO {min(fair_s) / min(fifo_s):.3f}")
    for line in extra:
        print(line)


if __name__ == "__main__":
    main()
