"""Benchmark: the fan-out workflow of scripts/bench_pipeline.py (two extractions of each document in parallel, then
one comparison) as a job through ``inf-engine serve`` in the embedded mode (no Redis: the server runs the node
tasks itself), against a fake OpenAI-compatible server at a fixed latency (its own process).

    .venv/bin/python scripts/bench_jobs_embedded.py [--items 500] [--latency 0.05] [--max-concurrent 64]
        [--database sqlite|postgres] [--repeat 3] [--tree before=/path/to/other/checkout ...]

``--tree LABEL=PATH`` runs the server from another checkout too (its code, this venv), alternating with this one,
so before and after of a change are measured in one run on one quiet machine. Makespan is from ``POST /v1/jobs``
to the job's terminal status (polled every 50 ms); ideal = calls x latency / max_concurrent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_platform import fake_server, scratch_database  # noqa: E402
from scripts.peers.bare_aiohttp_fanout import make_inputs  # noqa: E402
from scripts.peers.pyspy_profile import recording  # noqa: E402
from tests.support.cluster import free_port  # noqa: E402

PIPELINE = "scripts.peers.inf_engine_fanout:FanOut"
CPU: dict[str, list[float]] = {}  # tree -> the server's CPU seconds per run


class Server:
    """``inf-engine serve`` from ``tree`` on ``db_url`` (embedded: no Redis)."""

    def __init__(
        self, tree: Path, db_url: str | None, base_url: str, tmp: Path, max_concurrent: int, extra: list[str]
    ) -> None:
        resources = tmp / "resources.toml"
        resources.write_text(
            f'[endpoints.llm]\nprovider = "openai"\nmodel = "bench"\nbase_url = "{base_url}"\n'
            f'api_key = "sk-bench"\nmax_concurrent = {max_concurrent}\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
        env.update(
            INF_ENGINE_RESOURCES_FILE=str(resources),
            INF_ENGINE_DATA_DIR=str(tmp / "data"),
            INF_ENGINE_LOG_LEVEL="WARNING",
            INF_ENGINE_BACKEND="openai",
            INF_ENGINE_OPENAI_BASE_URL=base_url,
            INF_ENGINE_PIPELINE_MODULES=PIPELINE.partition(":")[0],
            INF_ENGINE_DEFAULT_MAX_CONCURRENT=str(max_concurrent),
            PYTHONPATH=f"{tree}{os.pathsep}{ROOT}",
        )
        if db_url:
            env["INF_ENGINE_DATABASE_URL"] = db_url
        env.update(pair.split("=", 1) for pair in extra)
        port = free_port()
        self.log = (tmp / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the server did not start; see {tmp}/serve.log")
            time.sleep(0.3)
        self.run(2)  # warm: the database, the pipeline and the endpoint all answer

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, all threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, items: int) -> float:
        inputs = [{"custom_id": f"d{i}", "input": text} for i, text in enumerate(make_inputs(items))]
        cpu = self.cpu_s()
        start = time.perf_counter()
        reply = self.http.post("/v1/jobs", json={"pipeline": PIPELINE, "inputs": inputs})
        if reply.status_code >= 300:
            raise RuntimeError(f"submit failed: {reply.status_code} {reply.text[:300]}")
        job_id = reply.json()["id"]
        while True:
            job = self.http.get(f"/v1/jobs/{job_id}").json()
            if job["status"] in ("completed", "failed", "cancelled"):
                elapsed = time.perf_counter() - start
                if job["counts"]["completed"] != items:
                    raise RuntimeError(f"job ended {job['status']} with counts {job['counts']}")
                self.last_cpu_s = self.cpu_s() - cpu
                return elapsed
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.http.close()
        self.log.close()


def measure(tree: Path, args: argparse.Namespace, base_url: str) -> float:
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-embedded-")))
        db_url = stack.enter_context(scratch_database(args.postgres)) if args.database == "postgres" else None
        server = Server(tree, db_url, base_url, tmp, args.max_concurrent, args.env)
        try:
            if args.py_spy and tree == ROOT:
                with recording([server.proc.pid], Path(args.py_spy)):
                    return server.run(args.items)
            return server.run(args.items)
        finally:
            CPU.setdefault(str(tree), []).append(getattr(server, "last_cpu_s", float("nan")))
            server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--max-concurrent", type=int, default=64)
    parser.add_argument("--database", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--postgres", default=os.environ.get("INF_ENGINE_TEST_POSTGRES",
                                                             "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH of another checkout to run too")
    parser.add_argument("--env", action="append", default=[], metavar="INF_ENGINE_X=VALUE",
                        help="a setting for every server of the run")
    parser.add_argument("--py-spy", metavar="DIR", help="record this tree's server with py-spy into DIR")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + [(t.partition("=")[0], Path(t.partition("=")[2]).resolve()) for t in args.tree]
    ideal = max(3 * args.items * args.latency / args.max_concurrent, 2 * args.latency)
    print(f"fan-out job through `inf-engine serve` (embedded, {args.database}): {args.items} items, "
          f"{3 * args.items} calls at {args.latency * 1000:.0f} ms, max_concurrent {args.max_concurrent}; "
          f"ideal {ideal:.2f} s")
    times: dict[str, list[float]] = {label: [] for label, _ in trees}
    with fake_server(args.latency) as base_url:
        for _ in range(args.repeat):  # interleaved, so drift on the machine hits every tree alike
            for label, tree in trees:
                times[label].append(measure(tree, args, base_url))
    print(f"{'server':<20} {'best s':>8} {'median s':>9} {'x ideal':>8} {'CPU s':>6}  runs")
    for label, tree in trees:
        runs = times[label]
        cpu = statistics.median(CPU.get(str(tree), [float("nan")]))
        print(f"{label:<20} {min(runs):>8.2f} {statistics.median(runs):>9.2f} {min(runs) / ideal:>8.2f} {cpu:>6.2f}  "
              + ", ".join(f"{t:.2f}" for t in runs))


if __name__ == "__main__":
    main()
