"""Where quantization "auto" should hand decode steps from the GGUF blocks to the float weights: decode tok/s of
N concurrent streams on the default model, the blocks (``quantization="gguf"``) against the float weights alone
(``quantization="none"``), side by side in one run (app/engine/models/quantization.py's AUTO_BLOCK_ROWS*).

    .venv/bin/python scripts/bench_engine_rows.py                          # the dtype auto picks on this CPU
    .venv/bin/python scripts/bench_engine_rows.py --dtype float32 --counts 1,2,4,8,16,24,32

Each count runs on both engines in turn, twice (``--repeats``), and the best run is shown: N random prompts of
16 tokens, ``--tokens`` greedy new tokens each (``ignore_eos``), so a step has N rows once the prefill is done.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.engine import LLMEngine, SamplingParams  # noqa: E402


def tokens_per_s(engine: LLMEngine, streams: int, new_tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, [params] * streams)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto (as the engine picks), float32 or bfloat16")
    parser.add_argument("--counts", default="1,2,3,4,6,8,16,24,32", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per stream")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    try:
        counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        parser.error(f"--counts must be integers separated by commas, not {args.counts!r}")
    if any(c < 1 for c in counts) or args.tokens < 1 or args.repeats < 1:
        parser.error("--counts, --tokens and --repeats must be at least 1")
    common = dict(num_threads=args.threads, max_model_len=1024, seed=0, dtype=args.dtype)
    engines = {"blocks (gguf)": LLMEngine(quantization="gguf", **common),
               "float (none)": LLMEngine(quantization="none", **common)}
    for engine in engines.values():
        tokens_per_s(engine, 2, 8, seed=99)  # warm: kernels, buffers
    dtype = str(engines["float (none)"].dtype).removeprefix("torch.")
    print(f"decode tok/s by concurrent streams, {dtype} weights beside the blocks, {args.threads} threads, "
          f"{args.tokens} new tokens a stream, best of {args.repeats}")
    print(f"{'streams':>8} " + " ".join(f"{name:>14}" for name in engines) + "  faster")
    for count in counts:
        best = {name: 0.0 for name in engines}
        for repeat in range(args.repeats):
            for name, engine in engines.items():
                best[name] = max(best[name], tokens_per_s(engine, count, args.tokens, seed=repeat))
        winner = max(best, key=lambda name: best[name])
        print(f"{count:>8} " + " ".join(f"{best[name]:>14.1f}" for name in engines) + f"  {winner}")


if __name__ == "__main__":
    main()
