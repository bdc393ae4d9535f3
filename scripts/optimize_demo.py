"""Optimise a learnable system prompt on a small verifiable task and report held-out scores, honestly.

The pipeline is the ``sentiment`` example (one LLM call whose system prompt is a learnable Parameter, starting
from "You read product reviews."); the task is to answer a product review with its label, ``positive`` or
``negative``, checked by code (``VerifierLoss``): an output passes when it names the right label and not the
other. The same model is the pipeline and the optimizer (``optimizer/aggregator``, ``optimizer/updater``).

By default everything runs in this process on SmolLM2-135M-Instruct through the embedded engine (no server);
``--base-url``/``--model`` point every alias at an OpenAI-compatible endpoint instead.

For each seed: train one epoch with SFAOptimizer on the training split (the seed orders the batches), then score
the held-out split with the trained prompt. The "before" score is measured once: the starting prompt is the same
for every seed and decoding is greedy (temperature 0), so it does not depend on the seed. The updater samples
(temperature 0.7) without a fixed sampling seed, so a rerun may give different prompts.

    .venv/bin/python scripts/optimize_demo.py                    # SmolLM2 in process, seeds 0 1 2
    .venv/bin/python scripts/optimize_demo.py --base-url http://127.0.0.1:8000/v1 --model my-model
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

from app.examples.sentiment import SentimentLabel
from app.pipeline import EndpointConfig, ResourceConfig, ResourceManager
from app.pipeline.optimization import SFAOptimizer, VerifierLoss, evaluate, train

ALIASES = ["assistant", "optimizer/aggregator", "optimizer/updater"]

TRAIN = [
    ("The battery died after two days and support never answered my emails.", "negative"),
    ("Absolutely love this blender, it crushes ice in seconds.", "positive"),
    ("Cheap plastic that cracked the first time I used it.", "negative"),
    ("Great sound and the headphones are comfortable for hours.", "positive"),
    ("The package arrived late and the screen was scratched.", "negative"),
    ("Best coffee grinder I have owned, quiet and consistent.", "positive"),
]
HELD_OUT = [
    ("Stopped charging after a week; a waste of money.", "negative"),
    ("The jacket is warm, light and the zipper is sturdy.", "positive"),
    ("Instructions were useless and two screws were missing.", "negative"),
    ("My kids use this tablet every day and it still works perfectly.", "positive"),
    ("The mattress sags in the middle and smells of chemicals.", "negative"),
    ("Fast shipping and the lamp looks even better than the photos.", "positive"),
]


def verify(output: Any, target: str) -> tuple[bool, str]:
    """Pass when the answer names the right label and not the other one."""
    text = str(output).strip().lower()
    other = "negative" if target == "positive" else "positive"
    if target in text and other not in text:
        return True, ""
    return False, (
        f"The review is {target}. The answer must be the single word '{target}' "
        f"(nothing else), but it was {str(output).strip()!r}."
    )


def resources(args: argparse.Namespace) -> Any:
    if args.base_url:
        endpoint = EndpointConfig("openai", args.model, base_url=args.base_url, api_key=args.api_key)
        return ResourceManager(ResourceConfig({alias: endpoint for alias in ALIASES}))
    from app.serving.embedded import embedded_resources, register_embedded_engine

    register_embedded_engine(num_threads=args.threads)
    return ResourceManager(embedded_resources(ALIASES, args.model))


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    manager = resources(args)
    loss = VerifierLoss(verify, success_feedback="Correct label, nothing else.")
    rows: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        before = await evaluate(SentimentLabel(), HELD_OUT, loss, resources=manager)
        print(
            f"held-out before training: {before.score:.3f} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        show(before, args.verbose)
        for seed in args.seeds:
            started = time.perf_counter()
            module = SentimentLabel()
            optimizer = SFAOptimizer(
                module.parameters(), conservatism=args.conservatism, max_tokens=args.optimizer_tokens
            )
            history = await train(
                module,
                TRAIN,
                loss,
                optimizer,
                epochs=args.epochs,
                batch_size=args.batch_size,
                seed=seed,
                resources=manager,
            )
            after = await evaluate(module, HELD_OUT, loss, resources=manager)
            rows.append(
                {
                    "seed": seed,
                    "before": before.score,
                    "after": after.score,
                    "train_scores": history.scores,
                    "changed": sum(1 for u in history.updates if u.changed),
                    "prompt": history.final_state["classify.system_prompt"],
                    "seconds": time.perf_counter() - started,
                }
            )
            print(
                f"seed {seed}: held-out {before.score:.3f} -> {after.score:.3f} "
                f"({rows[-1]['seconds']:.0f} s); prompt: {rows[-1]['prompt']!r}",
                flush=True,
            )
            show(after, args.verbose)
    finally:
        await manager.aclose()
    return rows


def show(result: Any, verbose: bool) -> None:
    """Failed examples always (an error is not a wrong answer); each answer's feedback with --verbose."""
    for index, error in result.errors.items():
        print(f"  example {index} failed: {error}")
    if verbose:
        for index, feedback in enumerate(result.feedback):
            if feedback is not None:
                print(f"  example {index}: score {feedback.score}: {feedback.content}")


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| seed | held-out before | held-out after | batch scores (train) | prompt updates | final system prompt |",
        "|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        prompt = " ".join(str(row["prompt"]).split())
        prompt = prompt if len(prompt) <= 90 else prompt[:87] + "..."
        batch = ", ".join("-" if s is None else f"{s:.2f}" for s in row["train_scores"])
        lines.append(
            f"| {row['seed']} | {row['before']:.3f} | {row['after']:.3f} | {batch} | {row['changed']} | "
            f"{prompt.replace('|', '/')} |"
        )
    afters = [row["after"] for row in rows]
    spread = f" ± {statistics.stdev(afters):.3f}" if len(afters) > 1 else ""
    lines.append(f"| mean | {rows[0]['before']:.3f} | {statistics.mean(afters):.3f}{spread} | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=3)
    parser.add_argument("--conservatism", type=float, default=0.5)
    parser.add_argument(
        "--optimizer-tokens", type=int, default=64, help="max_tokens of the optimizer's answers"
    )
    parser.add_argument("--model", default=None, help="GGUF/HF path in process, or the endpoint's model name")
    parser.add_argument("--base-url", default=None, help="An OpenAI-compatible endpoint (with /v1) instead")
    parser.add_argument("--api-key", default="sk-none")
    parser.add_argument("--verbose", action="store_true", help="Print the feedback on every held-out answer")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine")
    args = parser.parse_args()
    if args.base_url and not args.model:
        parser.error("--base-url needs --model (the name the endpoint serves)")
    started = time.perf_counter()
    rows = asyncio.run(run(args))
    print()
    print(
        f"Task: label {len(HELD_OUT)} held-out reviews (trained on {len(TRAIN)}); model: "
        f"{args.model or 'SmolLM2-135M-Instruct (in process)'}; pipeline and optimizer are the same model."
    )
    print(table(rows))
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
