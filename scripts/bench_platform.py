"""Benchmark: the job platform on Celery workers, against the in-process runner and the bare transport.

The three-node fan-out pipeline (two extractions of each document in parallel, then one comparison; the same
workload as scripts/bench_pipeline.py) runs as a job on a fake OpenAI-compatible server (its own process) with
128 calls in flight at most, in two regimes:

* dispatch-bound: 2,000 items at 20 ms per call (the platform's own cost per node dominates);
* latency-bound:  600 items at 500 ms per call (the endpoint dominates; the platform should add little);

each with one and with two workers (threads pool; 128 task threads in all, split between the workers). In the
same run: a bare Celery no-op task (``inf.ping``: acks_late, prefetch 1, Redis) round trip and throughput, our
in-process ``run()`` (scripts/peers/inf_engine_fanout.py) and pyplait (the Python 3.13 venv of
scripts/setup_peers.sh; skipped when missing) on the same workload.

    INF_ENGINE_REDIS_URL=redis://127.0.0.1:6379/0 .venv/bin/python scripts/bench_platform.py
    .venv/bin/python scripts/bench_platform.py --dispatch-items 200 --latency-items 60 --latency-ms 200 \\
        --noop-tasks 300 --workers 1      # a quick check
    .venv/bin/python scripts/bench_platform.py --workers 1 --py-spy   # + a py-spy profile of the worker

Needs PostgreSQL (``--postgres``, a server URL without a database: a scratch database is created and dropped)
and Redis (``--redis``; keys under a scratch prefix, deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from redis import Redis  # noqa: E402
from sqlalchemy import text  # noqa: E402

from app.jobs.distributed.stages import diff_snapshots  # noqa: E402
from app.testing.fake_llm_server import start_fake_server_process, stop_fake_server_process  # noqa: E402
from scripts.peers.bare_aiohttp_fanout import make_inputs  # noqa: E402
from scripts.peers.pyspy_profile import recording, summarize  # noqa: E402

PIPELINE = "scripts.peers.inf_engine_fanout:FanOut"
CALLS_PER_ITEM = 3
CRITICAL_PATH = 2  # calls on the longest path of one item
PEERS = ROOT / "scripts" / "peers"


@dataclass
class Row:
    name: str
    items: int
    latency_s: float
    makespan_s: float
    ideal_s: float
    note: str = ""
    stages: list[dict[str, Any]] = field(default_factory=list)  # per worker: stage timers over the run
    db: dict[str, float] = field(default_factory=dict)  # PostgreSQL over the run: transactions, server CPU s
    profile: list[str] = field(default_factory=list)  # py-spy summary lines (--py-spy)

    @property
    def tasks(self) -> int:
        return CALLS_PER_ITEM * self.items


# -- scratch services -----------------------------------------------------------------------------------------
@contextmanager
def scratch_database(server: str) -> Iterator[str]:
    name = f"infe_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"{server}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def fake_server(latency: float) -> Iterator[str]:
    proc, base_url = start_fake_server_process(latency=latency)
    try:
        yield base_url
    finally:
        stop_fake_server_process(proc)


class Platform:
    """Workers of one measurement, and the settings the script uses to submit like the API does."""

    def __init__(self, db_url: str, redis_url: str, prefix: str, base_url: str, tmp: Path) -> None:
        resources = tmp / f"resources-{prefix}.toml"
        resources.write_text(
            f'[endpoints.llm]\nprovider = "openai"\nmodel = "bench-model"\nbase_url = "{base_url}"\n'
            'api_key = "sk-bench"\n'
        )
        self.env = {
            **os.environ,
            "INF_ENGINE_DATABASE_URL": db_url,
            "INF_ENGINE_REDIS_URL": redis_url,
            "INF_ENGINE_REDIS_PREFIX": prefix,
            "INF_ENGINE_CELERY_QUEUE_PREFIX": prefix,
            "INF_ENGINE_RESOURCES_FILE": str(resources),
            "INF_ENGINE_DATA_DIR": str(tmp / "data"),
            "INF_ENGINE_LOG_LEVEL": "WARNING",
            "INF_ENGINE_PIPELINE_MODULES": PIPELINE.partition(":")[0],
            "PYTHONPATH": str(ROOT),
        }
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        from app.settings import Settings

        self.settings = Settings(
            database_url=db_url,
            redis_url=redis_url,
            redis_prefix=prefix,
            celery_queue_prefix=prefix,
            resources_file=resources,
        )
        from app.jobs.distributed.transport.celery_dispatch import CeleryDispatcher
        from workers.celery_app import create_celery_app

        self.celery = create_celery_app(self.settings)
        self.dispatcher = CeleryDispatcher(self.celery, self.settings)
        from app.db import create_db_engine, make_session_factory

        self.engine = create_db_engine(db_url)
        self.sessions = make_session_factory(self.engine)

    def start_workers(self, count: int, threads: int) -> None:
        names = []
        for i in range(count):
            name = f"bench{i}.{self.settings.redis_prefix}@localhost"
            log = (self.tmp / f"worker-{self.settings.redis_prefix}-{i}.log").open("wb")
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "app.cli",
                        "worker",
                        "--queues",
                        "cpu,llm",
                        "--pool",
                        "threads",
                        "--concurrency",
                        str(threads),
                        "--name",
                        name,
                    ],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            names.append(name)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            replies = self.celery.control.ping(destination=names, timeout=1.0)
            if len(replies) == len(names):
                return
        raise RuntimeError(f"workers did not start; see {self.tmp}/worker-*.log")

    def stages(self) -> dict[str, dict[str, Any]]:
        """Each worker's stage timers (``inf_stages``), by node name."""
        names = [f"bench{i}.{self.settings.redis_prefix}@localhost" for i in range(len(self.procs))]
        replies = self.celery.control.broadcast("inf_stages", reply=True, destination=names, timeout=5.0)
        return {name: snap for reply in replies for name, snap in reply.items()}

    def run_job(self, items: int, poll: float = 0.05) -> float:
        """Submit a job of ``items`` documents as the API does and wait for it; returns the makespan."""
        from app.db import session_scope
        from app.jobs.distributed import dispatch_job
        from app.jobs.distributed.worker import endpoints_of, node_policy
        from app.jobs.registry import configure_registry
        from app.jobs.service import describe_job
        from app.jobs.submission import JobRequest, submit_job

        configure_registry([PIPELINE.partition(":")[0]])  # the operator registers the benchmark's pipeline
        inputs = [{"custom_id": f"d{i}", "input": text} for i, text in enumerate(make_inputs(items))]
        start = time.perf_counter()
        with session_scope(self.sessions) as session:
            job, _ = submit_job(session, JobRequest(PIPELINE, inputs=inputs))
        dispatch_job(
            self.sessions, job.id, self.dispatcher, endpoints_of(self.settings), node_policy(self.settings)
        )
        # poll the job's status alone (one indexed row): the observer should not load the two cores it measures
        status_of = text("SELECT status FROM jobs WHERE id = :id")
        with self.engine.connect() as conn:
            while conn.execute(status_of, {"id": job.id}).scalar_one() not in (
                "completed",
                "failed",
                "cancelled",
            ):
                conn.commit()  # a fresh snapshot for the next poll
                time.sleep(poll)
        makespan = time.perf_counter() - start
        with session_scope(self.sessions) as session:
            view = describe_job(session, job.id)
        if view["status"] != "completed" or view["counts"]["completed"] != items:
            raise RuntimeError(f"the job ended {view['status']} with counts {view['counts']}")
        return makespan

    def noop(self, tasks: int, round_trips: int) -> tuple[float, float]:
        """(median round trip in ms, tasks/s) of ``inf.ping`` on the running workers."""
        queue = f"{self.settings.celery_queue_prefix}.cpu"
        samples = []
        for i in range(round_trips):
            t0 = time.perf_counter()
            self.celery.send_task("inf.ping", args=[i], queue=queue).get(timeout=30)
            samples.append(time.perf_counter() - t0)
        start = time.perf_counter()
        with self.celery.producer_or_acquire() as producer:
            results = [
                self.celery.send_task("inf.ping", args=[i], queue=queue, producer=producer)
                for i in range(tasks)
            ]
        for result in results:
            result.get(timeout=120)
        elapsed = time.perf_counter() - start
        return statistics.median(samples) * 1000, tasks / elapsed

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.celery.close()
        self.dispatcher.close()
        self.engine.dispose()
        redis = Redis.from_url(self.settings.redis_url or "")
        keys = list(redis.scan_iter(match=f"{self.settings.redis_prefix}*", count=1000))
        if keys:
            redis.delete(*keys)
        redis.close()


# -- the measurements -----------------------------------------------------------------------------------------
def ideal(items: int, latency: float, concurrency: int) -> float:
    return max(CALLS_PER_ITEM * items * latency / concurrency, CRITICAL_PATH * latency)


def platform_run(
    args: argparse.Namespace,
    db_server: str,
    workers: int,
    items: int,
    latency: float,
    tmp: Path,
    noop: Callable[[Platform], None] | None = None,
) -> Row:
    with scratch_database(db_server) as db_url, fake_server(latency) as base_url:
        from app.db.migrate import upgrade

        upgrade(db_url)
        platform = Platform(db_url, args.redis, f"infe_bench_{uuid.uuid4().hex[:8]}", base_url, tmp)
        try:
            platform.start_workers(workers, max(1, args.concurrency // workers))
            platform.run_job(min(20, items))  # warm-up: imports, connections, the pipeline loaded per process
            if noop is not None:
                noop(platform)
            before, db_before = platform.stages(), database_load(db_url)
            spy = args.py_spy and noop is not None  # the dispatch-bound runs
            with recording([p.pid for p in platform.procs], tmp, spy) as profiles:
                makespan = platform.run_job(items)
            after, db_after = platform.stages(), database_load(db_url)
            stages = [
                diff_snapshots(before[name], snap) for name, snap in sorted(after.items()) if name in before
            ]
        finally:
            platform.close()
    return Row(
        f"platform, {workers} worker{'s' if workers > 1 else ''}",
        items,
        latency,
        makespan,
        ideal(items, latency, args.concurrency),
        stages=stages,
        db={k: db_after[k] - db_before[k] for k in db_after},
        profile=[line for path in profiles for line in summarize(path)],
    )


def database_load(db_url: str) -> dict[str, float]:
    """The scratch database's committed and rolled-back transactions (its statistics, which backends flush when
    idle: read after a pause) and the CPU seconds of the local PostgreSQL server's processes (``/proc``; 0 where
    it is not on this machine). Both include the script's own polls (a few per second)."""
    time.sleep(1.5)  # backends flush their transaction counts after 1 s idle
    name = db_url.rsplit("/", 1)[-1]
    server = db_url.rsplit("/", 1)[0].replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (name,)
        ).fetchone()
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if fields[0].endswith("(postgres"):
                ticks += sum(int(v) for v in fields[1].split()[11:13])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return {"xacts": float(row[0] if row else 0), "pg_cpu_s": ticks / os.sysconf("SC_CLK_TCK")}


def peer_run(
    name: str, command: list[str], items: int, latency: float, args: argparse.Namespace
) -> Row | str:
    with fake_server(latency) as base_url:
        full = [
            *command,
            "--base-url",
            base_url,
            "--items",
            str(items),
            "--max-concurrent",
            str(args.concurrency),
        ]
        done = subprocess.run(
            full, capture_output=True, text=True, timeout=args.timeout, check=False, cwd=ROOT
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return f"{name} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    result = json.loads(lines[-1])
    return Row(
        name,
        items,
        latency,
        float(result["makespan_s"]),
        ideal(items, latency, args.concurrency),
        f"ok {result.get('ok')}/{items}",
    )


def peers(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    found = [("in-process run()", [sys.executable, str(PEERS / "inf_engine_fanout.py")])]
    pyplait = Path(os.environ.get("PYPLAIT_VENV", ROOT / ".venv-pyplait")) / "bin" / "python"
    if pyplait.exists() and not args.no_pyplait:
        found.append(("pyplait", [str(pyplait), str(PEERS / "pyplait_fanout.py"), "--resources", "manager"]))
    elif not args.no_pyplait:
        print(f"pyplait skipped: {pyplait} not found (run: bash scripts/setup_peers.sh)", file=sys.stderr)
    return found


def print_table(title: str, rows: list[Row | str]) -> None:
    print(f"\n{title}")
    header = (
        f"{'run':<22} {'items':>6} {'makespan s':>11} {'ideal s':>8} {'x ideal':>8} {'node tasks/s':>13} "
        f"{'overhead ms/node':>17}  note"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if isinstance(row, str):
            print(row)
            continue
        rate = row.tasks / row.makespan_s
        overhead = (row.makespan_s - row.ideal_s) / row.tasks * 1000
        print(
            f"{row.name:<22} {row.items:>6} {row.makespan_s:>11.2f} {row.ideal_s:>8.2f} "
            f"{row.makespan_s / row.ideal_s:>7.2f}x {rate:>13.1f} {overhead:>17.2f}  {row.note}"
        )
        for line in breakdown(row):
            print(line)
        if row.db:
            print(
                f"  PostgreSQL: {row.db['xacts'] / row.tasks:.2f} transactions per node, server CPU "
                f"{row.db['pg_cpu_s'] / row.tasks * 1000:.2f} ms per node (all its processes)"
            )
        for line in row.profile:
            print(line)


STAGES = ("claim", "load", "call", "store", "publish")


def breakdown(row: Row) -> list[str]:
    """Where one node's milliseconds went, per worker: CPU ms per node by thread and stage (the task threads'
    stages as timed by ``app.jobs.distributed.stages``), and the mean wall ms of each stage."""
    lines = []
    for i, snap in enumerate(row.stages):
        nodes = row.tasks / len(row.stages)  # each worker's share, assuming an even split
        stages = snap["stages"]
        cpu = {s: stages.get(s, [0.0, 0.0, 0])[1] for s in (*STAGES, "task")}
        consumer = snap["threads"].get("consumer", 0.0)
        loop = snap["threads"].get("loop", 0.0)
        committer = max(0.0, snap["threads"].get("committer", 0.0))  # 0 if it restarted between snapshots
        celery_pool = cpu["task"] - sum(cpu[s] for s in STAGES)  # the task body outside our stages
        # the rest of the process: Celery's task wrapper and ack in the pool threads, other threads (beat of
        # presence, metrics flush), the garbage collector
        rest = snap["process_cpu_s"] - consumer - loop - committer - cpu["task"]
        share = {
            "consumer (receive, decode, hand over)": consumer,
            "event loop (HTTP call, limiter)": loop,
            **{f"task: {s}": cpu[s] for s in STAGES},
            "task: rest of body": celery_pool,
            "node store committer (batches of SQL)": committer,
            "Celery pool wrapper, ack, other threads": rest,
        }
        total = snap["process_cpu_s"]
        lines.append(
            f"  worker {i}: {total / nodes * 1000:.2f} CPU ms per node over {nodes:.0f} nodes, "
            f"peak RSS {snap['peak_rss_kb'] / 1024:.0f} MiB"
        )
        lines.extend(f"    {name:<42} {sec / nodes * 1000:7.3f} ms" for name, sec in share.items())
        walls = ", ".join(
            f"{s} {stages[s][0] / stages[s][2] * 1000:.2f}"
            for s in (*STAGES, "task")
            if stages.get(s, [0, 0, 0])[2]
        )
        lines.append(f"    mean wall ms per stage: {walls}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dispatch-items", type=int, default=2000)
    parser.add_argument(
        "--dispatch-ms", type=float, default=20.0, help="latency per call, dispatch-bound regime"
    )
    parser.add_argument("--latency-items", type=int, default=600)
    parser.add_argument(
        "--latency-ms", type=float, default=500.0, help="latency per call, latency-bound regime"
    )
    parser.add_argument("--concurrency", type=int, default=128, help="calls in flight at most (task threads)")
    parser.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    parser.add_argument("--noop-tasks", type=int, default=2000, help="no-op tasks for the Celery throughput")
    parser.add_argument("--round-trips", type=int, default=100, help="sequential no-op round trips")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("INF_ENGINE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
    )
    parser.add_argument("--redis", default=os.environ.get("INF_ENGINE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--no-pyplait", action="store_true")
    parser.add_argument(
        "--py-spy",
        action="store_true",
        help="profile each worker during the dispatch-bound runs (pip install py-spy)",
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    regimes = [
        ("dispatch-bound", args.dispatch_items, args.dispatch_ms / 1000),
        ("latency-bound", args.latency_items, args.latency_ms / 1000),
    ]
    noop_rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="infe_bench_platform_") as tmpdir:
        tmp = Path(tmpdir)
        for title, items, latency in regimes:
            rows: list[Row | str] = []
            for workers in counts:

                def measure_noop(platform: Platform, workers: int = workers) -> None:
                    rtt, rate = platform.noop(args.noop_tasks, args.round_trips)
                    noop_rows.append(
                        f"bare Celery no-op (inf.ping), {workers} worker(s): round trip {rtt:.2f} ms "
                        f"(median of {args.round_trips}), {rate:.0f} tasks/s ({args.noop_tasks} tasks)"
                    )

                try:
                    noop = measure_noop if title == "dispatch-bound" else None
                    rows.append(platform_run(args, args.postgres, workers, items, latency, tmp, noop))
                except Exception as exc:
                    rows.append(f"platform, {workers} worker(s) failed: {exc}")
            for name, command in peers(args):
                rows.append(peer_run(name, command, items, latency, args))
            print_table(
                f"{title}: {items} items x {CALLS_PER_ITEM} calls at {latency * 1000:.0f} ms, "
                f"concurrency {args.concurrency}",
                rows,
            )
    print()
    for line in noop_rows:
        print(line)


if __name__ == "__main__":
    main()
