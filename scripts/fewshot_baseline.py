"""How far labelled demonstrations alone move a small model, with no optimizer: the ``sentiment`` example on its
shipped test split, with the starting prompt and 0, 3 or 6 demonstrations drawn from the train split.

Demonstrations are attached to the pipeline's one LLM call (``attach_demonstrations``) and filled with labelled
training examples (``candidates_from_examples``, DSPy's LabeledFewShot), drawn per seed either at random or
balanced (the same number per label). The score is the API's ``exact`` metric; per-label accuracy and what the
model answered show whether a score comes from learning or from always answering one label.

    .venv/bin/python scripts/fewshot_baseline.py                      # SmolLM2 in process
    .venv/bin/python scripts/fewshot_baseline.py --shots 0 3 6 --seeds 0 1 2 --draw balanced
    .venv/bin/python scripts/fewshot_baseline.py --base-url http://127.0.0.1:8000/v1 --model my-model

``fewshot_rows(manager, ...)`` is the function a demo calls with its own resources.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.examples.datasets import labels, load_split
from app.examples.sentiment import SentimentLabel
from app.jobs.learning.specs import make_check
from app.pipeline import EndpointConfig, ResourceConfig, ResourceManager
from app.pipeline.optimization import (
    VerifierLoss,
    attach_demonstrations,
    candidates_from_examples,
    evaluate,
)

TASK = "sentiment3"  # measured first on the three-way task; ``--task sentiment`` for the two-way example


@dataclass
class Row:
    """One measured configuration: ``shots`` demonstrations drawn with ``seed`` (None: no demonstrations)."""

    shots: int
    seed: int | None
    accuracy: float
    per_label: dict[str, float]
    answers: Counter[str] = field(default_factory=Counter)  # what the model answered, as a label or "other"
    demos: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def draw_demos(train: list[dict[str, Any]], shots: int, seed: int, draw: str) -> list[dict[str, Any]]:
    """``shots`` labelled demonstrations from ``train``: at random, or as many of each label (in turn)."""
    (candidates,) = candidates_from_examples(SentimentLabel(), train).values()
    rng = random.Random(seed)
    if draw == "random":
        return [c.demo() for c in rng.sample(candidates, shots)]
    by_label: dict[str, list[Any]] = defaultdict(list)
    for candidate in candidates:
        by_label[str(candidate.output)].append(candidate)
    pools = [rng.sample(pool, len(pool)) for _, pool in sorted(by_label.items())]
    rng.shuffle(pools)  # which label comes last (nearest the input) depends on the seed too
    picked = [pools[i % len(pools)][i // len(pools)] for i in range(shots)]
    return [c.demo() for c in picked]


async def score_demos(manager: Any, demos: list[dict[str, Any]], test: list[dict[str, Any]]) -> Row:
    """The test accuracy of the starting prompt with ``demos``, per label, and the answers given."""
    exact = make_check("exact")
    answered: list[tuple[str, str]] = []
    known = sorted({str(e["target"]) for e in test})

    def verify(output: Any, target: Any) -> Any:
        words = str(output).strip().lower()
        answered.append((str(target), next((label for label in known if label in words), "other")))
        return exact(output, target)

    module = SentimentLabel()
    attach_demonstrations(module)["classify"].apply_update(demos)
    started = time.perf_counter()
    result = await evaluate(module, test, VerifierLoss(verify), resources=manager)
    per_label = {}
    for label in known:
        scores = [s or 0.0 for s, e in zip(result.scores, test, strict=True) if e["target"] == label]
        per_label[label] = sum(scores) / len(scores)
    return Row(len(demos), None, result.score or 0.0, per_label, Counter(a for _, a in answered), demos,
               time.perf_counter() - started)


async def fewshot_rows(
    manager: Any, shots: list[int], seeds: list[int], draw: str = "random", split: str = "test",
    only: list[str] | None = None, task: str = TASK,
) -> list[Row]:
    """Every (shots, seed) configuration on ``split``; 0 shots is measured once (greedy decoding: no seed).
    ``only`` keeps the examples of those labels (both splits), e.g. a two-way task of positive and negative."""
    train, test = load_split(task, "train"), load_split(task, split)
    if only:
        train, test = ([e for e in rows if e["target"] in only] for rows in (train, test))
    rows = []
    for count in shots:
        for seed in [None] if count == 0 else seeds:
            demos = [] if seed is None else draw_demos(train, count, seed, draw)
            row = await score_demos(manager, demos, test)
            row.seed = seed
            rows.append(row)
            print(f"{count} shots, seed {seed}: {row.accuracy:.3f} {fmt_labels(row)} ({row.seconds:.0f} s)",
                  flush=True)
    return rows


def fmt_labels(row: Row) -> str:
    per = ", ".join(f"{label} {score:.2f}" for label, score in row.per_label.items())
    said = ", ".join(f"{answer} {n}" for answer, n in row.answers.most_common())
    return f"[{per}] answers: {said}"


def table(rows: list[Row]) -> str:
    known = list(rows[0].per_label)
    lines = [
        "| shots | seed | accuracy | " + " | ".join(known) + " | answers |",
        "|---:|---:|---:|" + "---:|" * len(known) + "---|",
    ]
    for row in rows:
        said = ", ".join(f"{a} {n}" for a, n in row.answers.most_common())
        cells = " | ".join(f"{row.per_label[label]:.2f}" for label in known)
        seed = "-" if row.seed is None else str(row.seed)
        lines.append(f"| {row.shots} | {seed} | {row.accuracy:.3f} | {cells} | {said} |")
    return "\n".join(lines)


def resources(args: argparse.Namespace) -> Any:
    if args.base_url:
        endpoint = EndpointConfig("openai", args.model, base_url=args.base_url, api_key=args.api_key)
        return ResourceManager(ResourceConfig({"assistant": endpoint}))
    from app.serving.embedded import embedded_resources, register_embedded_engine

    register_embedded_engine(num_threads=args.threads)
    return ResourceManager(embedded_resources(["assistant"], args.model))


async def main_async(args: argparse.Namespace) -> list[Row]:
    manager = resources(args)
    try:
        return await fewshot_rows(manager, args.shots, args.seeds, args.draw, args.split, args.labels, args.task)
    finally:
        await manager.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shots", type=int, nargs="+", default=[0, 3, 6])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--draw", choices=["random", "balanced"], default="random")
    parser.add_argument("--split", choices=["validation", "test"], default="test")
    parser.add_argument("--task", choices=["sentiment3", "sentiment"], default=TASK)
    parser.add_argument("--labels", nargs="+", choices=labels(TASK), help="Keep only these labels' examples")
    parser.add_argument("--model", default=None, help="GGUF/HF path in process, or the endpoint's model name")
    parser.add_argument("--base-url", default=None, help="An OpenAI-compatible endpoint (with /v1) instead")
    parser.add_argument("--api-key", default="sk-none")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine")
    args = parser.parse_args()
    if args.base_url and not args.model:
        parser.error("--base-url needs --model (the name the endpoint serves)")
    started = time.perf_counter()
    rows = asyncio.run(main_async(args))
    kept = [e for e in load_split(args.task, args.split) if not args.labels or e["target"] in args.labels]
    print(f"\n{args.task} {args.split} split ({len(kept)} reviews), draw {args.draw}; model "
          f"{args.model or 'SmolLM2-135M-Instruct (in process)'}; no optimizer")
    print(table(rows))
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
