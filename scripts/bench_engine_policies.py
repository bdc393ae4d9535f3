"""Our engine's prefix-cache eviction policies and batching strategies, side by side (issue 16).

    .venv/bin/python scripts/bench_engine_policies.py                  # both tables, 2 threads (~2-3 min)
    .venv/bin/python scripts/bench_engine_policies.py --part eviction --threads 4 --with-off

One set of SmolLM2-135M-Instruct weights (the default model, float32) is loaded once; every row is a fresh
``LLMEngine`` over it with its own small KV cache, so only the policy or strategy differs between rows.
Prompts are token ids from a fixed seed; decoding is greedy with ``ignore_eos``, so every request produces
exactly its ``max_tokens``. ``tok/s`` counts output tokens over the wall time of the whole workload.

1. Shared prefixes, per eviction policy (``kv_cache_eviction_policy``). Requests come one after another, each
   a system prompt of ``--prefix-len`` tokens plus 8 tokens of its own; the KV cache keeps the running
   request and about ``--cache-prefixes`` system prompts, so blocks are evicted. Two request streams:
   ``hot+one-off``: two popular system prompts among prompts seen once (LFU keeps the popular ones while the
   one-offs evict each other; FIFO evicts a popular prompt however often it is hit); ``shifting``: one prompt
   is popular for a while, then three others take turns (LFU holds on to the formerly popular one);
   ``alternating``: every other request has the same system prompt, the others one seen once (FIFO evicts
   it once it is the oldest entry, however recently hit).
   Hit rate = prompt tokens served from the cache / prompt tokens looked up.
2. Mixed lengths, per batching strategy (``batching_strategy``): long and short prompts, all submitted at
   once into a KV cache too small to hold every admitted sequence at its full length: ``continuous`` admits
   what fits now and preempts (recomputing prompts) as outputs grow, ``memory_aware`` admits by projected
   length, ``bucketed`` admits similar lengths together. TTFT is measured from submission (queueing included).

Figures are one run on whatever else the machine is doing: compare rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("lru", "lfu", "fifo")
STRATEGIES = ("continuous", "bucketed", "memory_aware")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "eviction", "batching"), default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    # shared-prefix workloads
    p.add_argument("--prefix-len", type=int, default=96, help="tokens of a system prompt")
    p.add_argument("--requests", type=int, default=16, help="requests of each shared-prefix stream")
    p.add_argument("--cache-prefixes", type=int, default=3, help="system prompts the KV cache can keep")
    p.add_argument("--prefix-max-tokens", type=int, default=4, help="new tokens per shared-prefix request")
    p.add_argument("--with-off", action="store_true", help="add a row with prefix caching off")
    # mixed-length workload
    p.add_argument("--mixed-requests", type=int, default=12)
    p.add_argument("--mixed-max-tokens", type=int, default=48)
    p.add_argument("--mixed-kv-blocks", type=int, default=48, help="KV blocks for the mixed-length runs")
    p.add_argument("--bucket-size", type=int, default=128, help="batching_bucket_size of the bucketed row")
    return p.parse_args(argv)


# ---- workloads ----------------------------------------------------------------------------------------------


def prefix_streams(args: argparse.Namespace, vocab: int) -> dict[str, list[list[int]]]:
    """The two request streams (see the module docstring), as prompts in arrival order."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    hot = [tokens(args.prefix_len) for _ in range(4)]
    draws = [rng.random() for _ in range(args.requests)]
    mixed = [hot[0] if r < 0.15 else hot[1] if r < 0.3 else tokens(args.prefix_len) for r in draws]
    first = args.requests // 3  # hot[0] alone, then hot[1..3] in turn
    shifting = [hot[0]] * first + [hot[1 + i % 3] for i in range(args.requests - first)]
    alternating = [hot[0] if i % 2 else tokens(args.prefix_len) for i in range(args.requests)]
    return {
        "hot+one-off": [p + tokens(8) for p in mixed],
        "shifting": [p + tokens(8) for p in shifting],
        "alternating": [p + tokens(8) for p in alternating],
    }


def mixed_requests(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Half long prompts (256-384 tokens), half short (16-48), shuffled."""
    rng = random.Random(args.seed + 1)
    lengths = [rng.randint(256, 384) if i % 2 else rng.randint(16, 48) for i in range(args.mixed_requests)]
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


# ---- runs ---------------------------------------------------------------------------------------------------


class Weights:
    """The default model, loaded once; ``engine(**options)`` builds an engine with its own KV cache."""

    def __init__(self, threads: int) -> None:
        import torch

        from app.engine.loading import load_model

        torch.set_num_threads(threads)
        self.model, self.tokenizer, self.config = load_model(None)
        cfg = self.config
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32

    def engine(self, blocks: int, block_size: int, **options: Any) -> Any:
        from app.engine.llm_engine import LLMEngine

        budget = blocks * block_size * self.kv_bytes_per_token
        engine = LLMEngine.from_loaded(
            self.model,
            self.tokenizer,
            self.config,
            kv_cache_memory_bytes=budget,
            block_size=block_size,
            seed=0,
            **options,
        )
        assert engine.block_manager.num_blocks == blocks
        return engine


def run_eviction(weights: Weights, args: argparse.Namespace) -> list[dict[str, Any]]:
    from app.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.prefix_max_tokens, ignore_eos=True)
    # The system prompts' full blocks, and the blocks of the running request's own tokens beyond them.
    prefix_blocks = args.prefix_len // args.block_size
    own = -(-(args.prefix_len + 8 + args.prefix_max_tokens) // args.block_size) - prefix_blocks
    blocks = args.cache_prefixes * prefix_blocks + own
    rows = []
    for stream, prompts in prefix_streams(args, weights.config.vocab_size).items():
        for policy in (*POLICIES, *([None] if args.with_off else [])):
            options: dict[str, Any] = (
                {"kv_cache_eviction_policy": policy} if policy else {"enable_prefix_caching": False}
            )
            engine = weights.engine(blocks, args.block_size, **options)
            start = time.perf_counter()
            generated = sum(len(engine.generate([p], params)[0].outputs[0].token_ids) for p in prompts)
            seconds = time.perf_counter() - start
            s = engine.get_stats()
            rows.append(
                {
                    "requests": stream,
                    "policy": policy or "off",
                    "hit rate": f"{s.prefix_cache_hit_rate:.1%}" if policy else "-",
                    "evicted blocks": s.prefix_cache_evictions if policy else "-",
                    "tok/s": f"{generated / seconds:.1f}",
                    "wall s": f"{seconds:.1f}",
                }
            )
            print(f"  {stream} {rows[-1]['policy']}: {seconds:.1f}s", file=sys.stderr, flush=True)
    return rows


def run_batching(weights: Weights, args: argparse.Namespace) -> list[dict[str, Any]]:
    from app.engine import SamplingParams

    prompts = mixed_requests(args, weights.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.mixed_max_tokens, ignore_eos=True)
    rows = []
    for strategy in STRATEGIES:
        engine = weights.engine(
            args.mixed_kv_blocks,
            args.block_size,
            batching_strategy=strategy,
            batching_bucket_size=args.bucket_size,
            enable_prefix_caching=False,  # distinct prompts: keep the cache out of this comparison
        )
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        ttfts = sorted(o.metrics.time_to_first_token or 0.0 for o in outputs if o.metrics is not None)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append(
            {
                "strategy": strategy,
                "tok/s": f"{generated / seconds:.1f}",
                "preemptions": engine.get_stats().num_preemptions,
                "steps": engine.get_stats().num_steps,
                "mean TTFT s": f"{statistics.fmean(ttfts):.2f}",
                "p90 TTFT s": f"{ttfts[int(0.9 * (len(ttfts) - 1))]:.2f}",
                "wall s": f"{seconds:.1f}",
            }
        )
        print(f"  batching {strategy}: {seconds:.1f}s", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(row[k]) for k in head) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    weights = Weights(args.threads)
    print(f"SmolLM2-135M-Instruct float32, {args.threads} threads, block size {args.block_size}\n")
    if args.part in ("all", "eviction"):
        print(
            f"### Shared prefixes: {args.requests} requests per stream, one at a time, a {args.prefix_len}-token "
            f"system prompt + 8 tokens each, {args.prefix_max_tokens} new tokens; KV cache for the running "
            f"request + {args.cache_prefixes} system prompts\n"
        )
        print(markdown(run_eviction(weights, args)) + "\n", flush=True)
    if args.part in ("all", "batching"):
        print(
            f"### Mixed lengths: {args.mixed_requests} requests at once, prompts 16-48 or 256-384 tokens, "
            f"{args.mixed_max_tokens} new tokens each; KV cache {args.mixed_kv_blocks} blocks of "
            f"{args.block_size}; bucketed by {args.bucket_size} tokens\n"
        )
        print(markdown(run_batching(weights, args)) + "\n", flush=True)
    print(f"({time.perf_counter() - t0:.0f}s in all; one run on a shared machine: figures are noisy)")


if __name__ == "__main__":
    main()
