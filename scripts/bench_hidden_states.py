"""What one request with captures and interventions costs the others of its batch (issue goal: under 5%).

    .venv/bin/python scripts/bench_hidden_states.py                 # SmolLM2, 64 requests x 64 tokens, 2 threads

Runs the same 64 greedy requests (``ignore_eos``) three ways on one engine, each repeated and the best kept:
all plain; one of them capturing every layer at every position; one of them capturing and steering (an ``add``
vector at a middle layer, two zeroed heads). Prints the other 63 requests' throughput side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import LLMEngine, SamplingParams
from app.engine.core.hidden_states import CaptureParams, parse_interventions


def run(engine: LLMEngine, prompts: list[str], special: SamplingParams | None, tokens: int) -> float:
    plain = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    params = [plain] * len(prompts)
    if special is not None:
        params[0] = special
    started = time.perf_counter()
    engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    return (len(prompts) - 1) * tokens / seconds  # the others' tokens per second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engine = LLMEngine(num_threads=args.threads, enable_prefix_caching=False)
    layers = engine.model_config.num_layers
    hidden = engine.model_config.hidden_size
    prompts = [f"Write a short note about topic number {i} and why it matters" for i in range(args.requests)]
    capture = CaptureParams.parse({"layers": list(range(layers)), "positions": "all"})
    cases = {
        "all plain": None,
        "one captures every layer": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                                                   capture=capture),
        "one captures and steers": SamplingParams(
            temperature=0.0, max_tokens=args.tokens, ignore_eos=True, capture=capture,
            interventions=parse_interventions([{"layer": layers // 2, "op": "add", "vector": [0.5] * hidden},
                                               {"layer": 1, "op": "zero_heads", "heads": [0, 1]}])),
    }
    run(engine, prompts[:4], None, 4)  # warm up
    best = {name: 0.0 for name in cases}
    for _ in range(args.repeat):  # interleaved, so slow phases of a shared machine hit every case alike
        for name, special in cases.items():
            best[name] = max(best[name], run(engine, prompts, special, args.tokens))
    base = best["all plain"]
    print(f"{args.requests} requests x {args.tokens} tokens, {args.threads} threads, best of {args.repeat}")
    print("| batch | the other requests' tok/s | against all plain |")
    print("|---|---:|---:|")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} | {rate / base - 1:+.1%} |")


if __name__ == "__main__":
    main()
