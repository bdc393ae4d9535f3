"""Train the ``sentiment`` example with the selection-gated optimizer on its shipped splits and report held-out
test scores before and after, per label, for several seeds, honestly.

The pipeline is the ``sentiment`` example (one LLM call whose system prompt is learnable, starting from "You read
product reviews."; ``SelectionOptimizer`` attaches learnable demonstrations to it). The task is to answer a
review with exactly ``positive`` or ``negative`` (the API's ``exact`` metric). The optimizer trains on
``sentiment:train``, chooses on ``sentiment:validation`` and never sees ``sentiment:test``, on which before and
after are measured. The same model is the pipeline and the optimizer (its instruction rewrites).

By default everything runs in this process on SmolLM2-135M-Instruct through the embedded engine (no server);
``--base-url``/``--model`` point every alias at an OpenAI-compatible endpoint instead. The "before" score is
measured once (greedy decoding and the same starting prompt for every seed). Per-label accuracy shows whether a
score comes from learning or from always answering one label.

    .venv/bin/python scripts/optimize_demo.py                    # SmolLM2 in process, seeds 0 1 2
    .venv/bin/python scripts/optimize_demo.py --budget 600 --candidates 4 --minibatch 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.examples.datasets import load_split
from app.examples.sentiment import SentimentLabel
from app.jobs.learning.specs import make_check
from app.pipeline import EndpointConfig, ResourceConfig, ResourceManager
from app.pipeline.optimization import SelectionOptimizer, VerifierLoss, evaluate

ALIASES = ["assistant", "optimizer/aggregator", "optimizer/updater"]
TASK = "sentiment"


def metric() -> VerifierLoss:
    """The API's ``exact`` check, with feedback the instruction rewriter can act on."""
    exact = make_check("exact")

    def verify(output: Any, target: Any) -> tuple[float, str]:
        score = float(exact(output, target)[0])
        why = "" if score >= 1.0 else (f"The review is {target}. The answer must be the single word '{target}' "
                                       f"(nothing else), but it was {str(output).strip()!r}.")
        return score, why
    return VerifierLoss(verify, success_feedback="Correct label, nothing else.")


def per_label(result: Any, examples: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for label in sorted({e["target"] for e in examples}):
        scores = [s or 0.0 for s, e in zip(result.scores, examples, strict=True) if e["target"] == label]
        out[label] = sum(scores) / len(scores)
    return out


def resources(args: argparse.Namespace) -> Any:
    if args.base_url:
        endpoint = EndpointConfig("openai", args.model, base_url=args.base_url, api_key=args.api_key)
        return ResourceManager(ResourceConfig({alias: endpoint for alias in ALIASES}))
    from app.serving.embedded import embedded_resources, register_embedded_engine

    register_embedded_engine(num_threads=args.threads)
    return ResourceManager(embedded_resources(ALIASES, args.model))


async def one_seed(args: argparse.Namespace, manager: Any, seed: int, before: dict[str, Any]) -> dict[str, Any]:
    train, val, test = (load_split(TASK, s) for s in ("train", "validation", "test"))
    started = time.perf_counter()
    module = SentimentLabel()
    optimizer = SelectionOptimizer(
        module, metric(), budget=args.budget, candidates_per_step=args.candidates, minibatch_size=args.minibatch,
        max_demos=args.max_demos, seed=seed, max_tokens=args.optimizer_tokens,
        rewrite_instructions=not args.no_rewrites,
    )
    result = await optimizer.fit(train, val, resources=manager)
    trained = time.perf_counter() - started
    after = await evaluate(module, test, metric(), resources=manager)
    accepted = [c for c in result.candidates[1:] if c.accepted]
    return {
        "seed": seed, "before": before["score"], "after": after.score or 0.0,
        "before_labels": before["labels"], "after_labels": per_label(after, test),
        "val": result.best_val_scores, "metric_calls": result.metric_calls, "steps": len(result.steps),
        "candidates": len(result.candidates) - 1, "accepted": len(accepted),
        "kinds": sorted({c.kind for c in accepted}), "state": result.final_state,
        "train_seconds": trained, "seconds": time.perf_counter() - started,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    manager = resources(args)
    test = load_split(TASK, "test")
    rows: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        result = await evaluate(SentimentLabel(), test, metric(), resources=manager)
        before = {"score": result.score or 0.0, "labels": per_label(result, test)}
        print(f"test before training: {before['score']:.3f} {before['labels']} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        for seed in args.seeds:
            row = await one_seed(args, manager, seed, before)
            rows.append(row)
            print(f"seed {seed}: test {row['before']:.3f} -> {row['after']:.3f} {row['after_labels']}; "
                  f"validation {row['val'][0]:.3f} -> {row['val'][-1]:.3f}; {row['metric_calls']} metric calls, "
                  f"{row['accepted']}/{row['candidates']} candidates accepted; training {row['train_seconds']:.0f} s",
                  flush=True)
            print(f"  final state: {row['state']}", flush=True)
    finally:
        await manager.aclose()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    labels = list(rows[0]["after_labels"])
    head = " | ".join(f"{label} after" for label in labels)
    lines = [f"| seed | test before | test after | gain | {head} | validation best | metric calls | accepted | "
             "training s |", "|---:|---:|---:|---:|" + "---:|" * len(labels) + "---:|---:|---|---:|"]
    for row in rows:
        cells = " | ".join(f"{row['after_labels'][label]:.2f}" for label in labels)
        lines.append(
            f"| {row['seed']} | {row['before']:.3f} | {row['after']:.3f} | {row['after'] - row['before']:+.3f} | "
            f"{cells} | {row['val'][-1]:.3f} | {row['metric_calls']} | {row['accepted']}/{row['candidates']} "
            f"({', '.join(row['kinds']) or '-'}) | {row['train_seconds']:.0f} |"
        )
    gains = [row["after"] - row["before"] for row in rows]
    spread = f" ± {statistics.stdev(gains):.3f}" if len(gains) > 1 else ""
    lines.append(f"| mean | {rows[0]['before']:.3f} | {statistics.mean(r['after'] for r in rows):.3f} | "
                 f"{statistics.mean(gains):+.3f}{spread} |" + " |" * len(labels) + " | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=600, help="metric calls per training")
    parser.add_argument("--candidates", type=int, default=4, help="candidates per step")
    parser.add_argument("--minibatch", type=int, default=8)
    parser.add_argument("--max-demos", type=int, default=4)
    parser.add_argument("--no-rewrites", action="store_true", help="search demonstrations only")
    parser.add_argument("--optimizer-tokens", type=int, default=64, help="max_tokens of the rewriter's answers")
    parser.add_argument("--model", default=None, help="GGUF/HF path in process, or the endpoint's model name")
    parser.add_argument("--base-url", default=None, help="An OpenAI-compatible endpoint (with /v1) instead")
    parser.add_argument("--api-key", default="sk-none")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine")
    args = parser.parse_args()
    if args.base_url and not args.model:
        parser.error("--base-url needs --model (the name the endpoint serves)")
    started = time.perf_counter()
    rows = asyncio.run(run(args))
    sizes = {s: len(load_split(TASK, s)) for s in ("train", "validation", "test")}
    print(f"\nTask: {TASK} ({sizes}); model {args.model or 'SmolLM2-135M-Instruct (in process)'} as pipeline and "
          f"optimizer; budget {args.budget} metric calls, {args.candidates} candidates per step, minibatch "
          f"{args.minibatch}, up to {args.max_demos} demonstrations")
    print(table(rows))
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
