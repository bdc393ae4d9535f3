"""Benchmark: the fan-out workflow (two parallel extractions, then one comparison) over N items against the
fake OpenAI-compatible server at a fixed latency, run by inf-engine and by its peers in the same run.

    .venv/bin/python scripts/bench_pipeline.py [--items 500] [--latency 0.05] [--max-concurrent 64] [--repeat 3]

Peers: a bare asyncio+aiohttp loop (the lower bound) and pyplait, the published version of this design
(needs Python 3.13: run `bash scripts/setup_peers.sh` once; skipped when its venv is missing). Every run gets a
fresh server process and its own client process; the table shows the best of --repeat runs and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.testing.fake_llm_server import start_fake_server_process, stop_fake_server_process  # noqa: E402

PEERS = ROOT / "scripts" / "peers"


def peer_commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    ours = [sys.executable, str(PEERS / "inf_engine_fanout.py")]
    commands = [
        ("inf-engine", ours),
        ("inf-engine (uvloop)", [*ours, "--uvloop"]),
        ("bare aiohttp loop", [sys.executable, str(PEERS / "bare_aiohttp_fanout.py")]),
    ]
    pyplait = Path(os.environ.get("PYPLAIT_VENV", ROOT / ".venv-pyplait")) / "bin" / "python"
    if pyplait.exists():
        script = str(PEERS / "pyplait_fanout.py")
        commands.append(("pyplait (README style)", [str(pyplait), script, "--resources", "config"]))
        commands.append(("pyplait (shared manager)", [str(pyplait), script, "--resources", "manager"]))
    else:
        print(f"pyplait skipped: {pyplait} not found (run: bash scripts/setup_peers.sh)", file=sys.stderr)
    return commands


def run_once(command: list[str], args: argparse.Namespace) -> dict[str, object]:
    proc, base_url = start_fake_server_process(latency=args.latency)
    try:
        full = [
            *command,
            "--base-url",
            base_url,
            "--items",
            str(args.items),
            "--max-concurrent",
            str(args.max_concurrent),
        ]
        done = subprocess.run(full, capture_output=True, text=True, timeout=args.timeout, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]}
        return json.loads(lines[-1])
    finally:
        stop_fake_server_process(proc)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--max-concurrent", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    calls = 3 * args.items
    ideal = max(calls * args.latency / args.max_concurrent, 2 * args.latency)
    print(
        f"fan-out workflow: {args.items} items x 3 calls = {calls} calls, {args.latency * 1000:.0f} ms per call, "
        f"max_concurrent {args.max_concurrent}; ideal makespan {ideal:.3f} s\n"
    )
    header = (
        f"{'framework':<26} {'ok':>9} {'best s':>8} {'median s':>9} {'best/ideal':>11} {'peak RSS MB':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, command in peer_commands(args):
        runs = [run_once(command, args) for _ in range(args.repeat)]
        good = [r for r in runs if "makespan_s" in r]
        if not good:
            print(f"{name:<26} failed: {runs[0].get('error')}")
            continue
        spans = [float(r["makespan_s"]) for r in good]  # type: ignore[arg-type]
        best = min(spans)
        ok = f"{min(int(r['ok']) for r in good)}/{args.items}"  # type: ignore[call-overload]
        rss = max(float(r["peak_rss_mb"]) for r in good)  # type: ignore[arg-type]
        print(
            f"{name:<26} {ok:>9} {best:>8.3f} {statistics.median(spans):>9.3f} {best / ideal:>10.2f}x {rss:>12.1f}"
        )


if __name__ == "__main__":
    main()
