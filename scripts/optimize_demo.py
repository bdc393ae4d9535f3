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
    .venv/bin/python scripts/optimize_demo.py --dspy-python .venv-dspy/bin/python   # ... and DSPy's, side by side

With ``--dspy-python``, DSPy's optimizers (GEPA, MIPROv2, BootstrapFewShotWithRandomSearch; see
``scripts/peers/dspy_sentiment.py``) then train the same model, served by ``inf-engine serve`` on a free port, on
the same splits, metric and budget, and their rows are printed in the same table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
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

ROOT = Path(__file__).resolve().parents[1]
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


def dspy_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """DSPy's optimizers on the same model, data, metric and budget, through our OpenAI-compatible server (started
    here on a free port unless ``--base-url`` names one), in DSPy's own venv; one row per training."""
    from scripts.peers.server_process import Target, free_port

    server = None
    base_url, model = args.base_url, args.model
    if base_url is None:
        port = free_port()
        command = [sys.executable, "-m", "app.cli", "serve", "--port", str(port)]
        if args.model:
            command += ["--model", args.model]
        log = ROOT / "out" / "optimize_demo" / "serve.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        server = Target("inf-engine serve", command, dict(os.environ), "", port, log)
        server.start(timeout=300)
        base_url = server.base_url
    command = [args.dspy_python, str(ROOT / "scripts" / "peers" / "dspy_sentiment.py"), "--base-url", base_url,
               "--budget", str(args.budget), "--json", "--seeds", *map(str, args.seeds),
               "--optimizers", *args.dspy_optimizers]
    if model:
        command += ["--model", model]
    print(f"\nDSPy: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, check=False)
    finally:
        if server is not None:
            server.stop()
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        rows.append({"optimizer": "dspy", "seed": "-", "error": f"the DSPy peer exited with {done.returncode}"})
    return rows


def table(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> str:
    """Ours and DSPy's trainings side by side: test before and after, per label, metric calls, training time."""
    labels = list(rows[0]["after_labels"])
    head = " | ".join(f"{label} after" for label in labels)
    lines = [f"| trainer | seed | test before | test after | gain | {head} | metric calls | training s | notes |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(labels) + "---:|---:|---|"]
    for row in rows:
        note = (f"validation {row['val'][0]:.3f} -> {row['val'][-1]:.3f}; accepted {row['accepted']}/"
                f"{row['candidates']} ({', '.join(row['kinds']) or '-'})")
        lines.append(_line("inf-engine selection", row, labels, note))
    for name, group in _by_trainer(rows, peers):
        gains = [r["after"] - r["before"] for r in group]
        spread = f" ± {statistics.stdev(gains):.3f}" if len(gains) > 1 else ""
        worst = min(gains)
        lines.append(f"| **{name} mean** | | {group[0]['before']:.3f} | {statistics.mean(r['after'] for r in group):.3f} "
                     f"| {statistics.mean(gains):+.3f}{spread} |" + " |" * len(labels)
                     + f" {statistics.mean(r['metric_calls'] for r in group):.0f} | "
                       f"{statistics.mean(r['train_seconds'] for r in group):.0f} | worst seed {worst:+.3f} |")
    for row in peers:
        name = f"DSPy {row.get('dspy', '')} {row['optimizer']}".replace("  ", " ")
        if row.get("error"):
            lines.append(f"| {name} | {row['seed']} | | failed | |" + " |" * len(labels)
                         + f" {row.get('metric_calls', '')} | | {row['error']} |")
        else:
            lines.append(_line(name, row, labels, f"{row['demos']} demonstrations"))
    return "\n".join(lines)


def _line(name: str, row: dict[str, Any], labels: list[str], note: str) -> str:
    cells = " | ".join(f"{row['after_labels'].get(label, 0.0):.2f}" for label in labels)
    return (f"| {name} | {row['seed']} | {row['before']:.3f} | {row['after']:.3f} | {row['after'] - row['before']:+.3f} "
            f"| {cells} | {row['metric_calls']} | {row['train_seconds']:.0f} | {note} |")


def _by_trainer(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    groups = [("inf-engine selection", rows)]
    for kind in dict.fromkeys(p["optimizer"] for p in peers):
        done = [p for p in peers if p["optimizer"] == kind and not p.get("error")]
        if done:
            groups.append((f"DSPy {kind}", done))
    return groups


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
    parser.add_argument("--dspy-python", default=None,
                        help="a Python with DSPy (e.g. .venv-dspy/bin/python): also train DSPy's optimizers")
    parser.add_argument("--dspy-optimizers", nargs="+", default=["gepa", "mipro", "bootstrap"],
                        choices=("gepa", "mipro", "bootstrap"), help="which DSPy optimizers to run")
    args = parser.parse_args()
    if args.base_url and not args.model:
        parser.error("--base-url needs --model (the name the endpoint serves)")
    started = time.perf_counter()
    rows = asyncio.run(run(args))
    peers = dspy_rows(args) if args.dspy_python else []
    sizes = {s: len(load_split(TASK, s)) for s in ("train", "validation", "test")}
    print(f"\nTask: {TASK} ({sizes}); model {args.model or 'SmolLM2-135M-Instruct (in process)'} as pipeline and "
          f"optimizer; budget {args.budget} metric calls, {args.candidates} candidates per step, minibatch "
          f"{args.minibatch}, up to {args.max_demos} demonstrations")
    print(table(rows, peers))
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
