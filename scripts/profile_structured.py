"""Where the time of JSON-schema decoding goes in our engine: a per-step breakdown, constrained against free.

    .venv/bin/python scripts/profile_structured.py --batch-size 64 --dtype float32

Runs the requests of ``scripts/bench_structured.py`` (cases 0..B-1 of ``scripts/peers/structured_workloads.py``,
greedy, prefix cache warmed) once constrained (``--max-tokens``) and once free with the same per-request lengths
(``ignore_eos``), with timers wrapped around the engine's parts (instance and class attributes patched at run
time, nothing in ``app/`` is changed): the model (``runner.execute``), the mask (``guided.bitmask_for``: the
matchers' sync, the bitmask allocation and the per-row ``fill``), the sampler (``sampler.sample``, of which
``apply_bitmask``), the matchers' advance (``guided.advance``), and the rest of the step. Prints ms per step and
per token for each part, both runs side by side, then micro-benchmarks of the pieces at this batch size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from structured_workloads import SCHEMAS, build_messages  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            COUNTS[name] += 1

    return wrapper


def instrument(engine: Any) -> None:
    import app.engine.guided.matcher as matcher_mod
    import app.engine.sampler as sampler_mod

    engine.runner.execute = timed("model (runner.execute)", engine.runner.execute)
    engine.guided.bitmask_for = timed("mask: guided.bitmask_for (all)", engine.guided.bitmask_for)
    engine.guided.advance = timed("advance: guided.advance", engine.guided.advance)
    engine.sampler.sample = timed("sampler.sample (all)", engine.sampler.sample)
    engine.scheduler.schedule = timed("scheduler.schedule", engine.scheduler.schedule)
    engine.scheduler.update = timed("scheduler.update", engine.scheduler.update)
    engine.output_processor.process = timed("output_processor.process", engine.output_processor.process)
    engine._step = timed("step (all)", engine._step)
    cls = matcher_mod.SequenceMatcher
    cls.fill = timed("mask:   SequenceMatcher.fill (xgrammar, per row)", cls.fill)
    cls.sync = timed("mask:   SequenceMatcher.sync", cls.sync)
    sampler_mod.apply_bitmask = timed("sampler:   apply_bitmask", sampler_mod.apply_bitmask)


def run(engine: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, dict[str, float], int, int]:
    """(wall s, seconds per part, steps, output tokens) of one generate call."""
    TIMES.clear()
    COUNTS.clear()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    times = dict(TIMES)
    if "mask: guided.bitmask_for (all)" in times:
        times["mask:   rest of bitmask_for (loop, torch.full alloc)"] = (
            times["mask: guided.bitmask_for (all)"]
            - times.get("mask:   SequenceMatcher.fill (xgrammar, per row)", 0.0)
            - times.get("mask:   SequenceMatcher.sync", 0.0)
        )
    if "sampler.sample (all)" in times:
        times["sampler:   rest (plan, float32 copy, argmax)"] = times["sampler.sample (all)"] - times.get(
            "sampler:   apply_bitmask", 0.0
        )
    return wall, times, COUNTS["step (all)"], tokens


def micro(engine: Any, batch: int, dtype: Any) -> None:
    import torch
    import xgrammar

    from app.engine import StructuredOutputsParams
    from app.engine.guided.bitmask import apply_bitmask_torch, bitmask_words

    vocab = engine.vocab_size
    words = bitmask_words(vocab)

    def best(fn: Callable[[], Any], n: int = 20) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1000, statistics.median(times) * 1000

    def show(label: str, fn: Callable[[], Any]) -> None:
        low, mid = best(fn)
        print(f"  {label:58s} {low:8.3f} / {mid:8.3f}")

    logits = torch.randn(batch, vocab).to(dtype)
    mask = torch.full((batch, words), -1, dtype=torch.int32)
    mask[:, 1::2] = 0  # half the tokens allowed
    rows = list(range(batch))
    work = torch.empty(batch, vocab, dtype=torch.float32)
    shifts = torch.arange(32, dtype=torch.int32)
    print(f"\nmicro-benchmarks at batch {batch}, logits {dtype} (min / median of 20, ms):")
    show("free path: logits.argmax(-1)", lambda: logits.argmax(-1))
    show("json_schema path: float32 copy of the logits", lambda: work.copy_(logits))
    show("json_schema path: apply_bitmask_torch (byte table)", lambda: apply_bitmask_torch(work, mask, rows))
    show("json_schema path: argmax of the float32 copy", lambda: work.argmax(-1))
    show("torch.full bitmask [B, words] int32", lambda: torch.full((batch, words), -1, dtype=torch.int32))
    show(
        "xgrammar.apply_token_bitmask_inplace (cpu)",
        lambda: xgrammar.apply_token_bitmask_inplace(work, mask),
    )
    show(
        "masked_fill_ with an unpacked bool mask (reference)",
        lambda: work.masked_fill_(
            ~((mask.unsqueeze(-1) >> shifts) & 1).view(batch, -1)[:, :vocab].bool(), -1e30
        ),
    )
    # the matchers: fill per row, serial vs xgrammar's BatchGrammarMatcher, in mid-output states
    compiler = engine.guided.compiler
    grammars = [
        compiler.compile(StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)].schema)) for i in range(batch)
    ]
    matchers = [xgrammar.GrammarMatcher(g) for g in grammars]
    prefix = '{"'
    for m in matchers:
        m.accept_string(prefix)
    bm = torch.full((batch, words), -1, dtype=torch.int32)

    def serial() -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bm, i)

    show(f"serial fill_next_token_bitmask x{batch} (after '{{\"')", serial)
    for threads in (1, 2):
        batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)
        show(
            f"BatchGrammarMatcher.batch_fill x{batch}, {threads} thread(s)",
            lambda batcher=batcher: batcher.batch_fill_next_token_bitmask(matchers, bm),
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind; the faster is shown")
    args = p.parse_args()

    from app.engine import LLMEngine, SamplingParams, StructuredOutputsParams

    engine = LLMEngine(
        num_threads=args.threads, dtype=args.dtype, kv_cache_memory_bytes=2 << 30, max_model_len=1024
    )
    render = engine.input_processor.render_chats
    n = args.batch_size
    prompts = [render(build_messages(i))[0][1] for i in range(n)]
    schemas = [SCHEMAS[i % len(SCHEMAS)].schema for i in range(n)]
    # warm: kernels, the prefix cache, the grammars
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)] * n)
    constrained = [
        SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=s)
        )
        for s in schemas
    ]
    outs = engine.generate(prompts, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in lengths]
    instrument(engine)
    results: dict[str, tuple[float, dict[str, float], int, int]] = {}
    for _ in range(args.repeats):
        for name, params in (("json_schema", constrained), ("free", free)):
            r = run(engine, prompts, params)
            if name not in results or r[0] < results[name][0]:
                results[name] = r
    print(
        f"\nbatch {n}, {args.dtype}, {args.threads} threads, {sum(lengths)} output tokens "
        f"(mean {sum(lengths) / n:.1f}); faster of {args.repeats} runs each"
    )
    names = sorted({k for r in results.values() for k in r[1]}, key=lambda k: (k != "step (all)", k))
    c, f = results["json_schema"], results["free"]
    print(f"{'':52s} {'json_schema':>12s} {'free':>12s} {'diff':>10s}   (ms per step)")
    print(f"{'wall of generate / steps':52s} {c[0] * 1000 / c[2]:12.3f} {f[0] * 1000 / f[2]:12.3f}")
    for k in names:
        cv, fv = c[1].get(k, 0.0) * 1000 / c[2], f[1].get(k, 0.0) * 1000 / f[2]
        print(f"{k:52s} {cv:12.3f} {fv:12.3f} {cv - fv:10.3f}")
    top = ("step", "mask:  ", "sampler:  ")
    rest_c = c[1]["step (all)"] - sum(v for k, v in c[1].items() if not k.startswith(top))
    rest_f = f[1]["step (all)"] - sum(v for k, v in f[1].items() if not k.startswith(top))
    print(f"{'rest of the step':52s} {rest_c * 1000 / c[2]:12.3f} {rest_f * 1000 / f[2]:12.3f}")
    print(f"steps: {c[2]} / {f[2]}; tokens: {c[3]} / {f[3]}; overhead of the wall: {c[0] / f[0] - 1:+.1%}")
    micro(engine, n, engine.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
