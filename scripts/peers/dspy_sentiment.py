"""DSPy's GEPA on the `sentiment` example's shipped splits, as a peer of scripts/optimize_demo.py: the same model
(served by our own OpenAI-compatible server), the same data, the same budget in metric calls, the same exact-match
metric, held-out test accuracy before and after.

DSPy runs in its own virtual environment (it pins its own dependencies); this file imports nothing of ours:

    python3.11 -m venv .venv-dspy && .venv-dspy/bin/pip install dspy
    .venv/bin/inf-engine serve --port 8011 &                 # SmolLM2-135M, the default model
    .venv-dspy/bin/python scripts/peers/dspy_sentiment.py --base-url http://127.0.0.1:8011/v1 --seeds 0 1 2

The program is one ``dspy.Predict`` whose instruction starts as our pipeline's ("You read product reviews.");
GEPA evolves the instruction with the same model as its reflection LM, choosing on the validation split; the test
split is scored before and after. Per-label accuracy shows whether a score is learning or one repeated label.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import dspy  # type: ignore[import-not-found]

EXAMPLES = Path(__file__).resolve().parents[2] / "app" / "examples"
LABELS = ("positive", "negative")


def split(name: str) -> list[Any]:
    rows = [json.loads(line) for line in (EXAMPLES / f"sentiment_{name}.jsonl").read_text().splitlines() if line]
    return [dspy.Example(review=r["input"], sentiment=r["target"]).with_inputs("review") for r in rows]


class Classify(dspy.Signature):  # type: ignore[misc]
    """You read product reviews."""

    review: str = dspy.InputField()
    sentiment: str = dspy.OutputField(desc="exactly one word: positive or negative")


def answer(pred: Any) -> str:
    return str(getattr(pred, "sentiment", "") or "").strip().lower()


def metric(gold: Any, pred: Any, trace: Any = None, pred_name: Any = None, pred_trace: Any = None) -> Any:
    got = answer(pred)
    ok = got == gold.sentiment
    feedback = "Correct." if ok else f"The answer must be exactly {gold.sentiment!r}, with nothing else; got {got!r}."
    return dspy.Prediction(score=float(ok), feedback=feedback)


def test_score(program: Any, test: list[Any], threads: int) -> tuple[float, dict[str, float]]:
    right: dict[str, list[bool]] = {label: [] for label in LABELS}

    def one(example: Any) -> None:
        try:
            got = answer(program(review=example.review))
        except Exception:  # an answer DSPy cannot parse counts as wrong, as our metric counts it
            got = ""
        right[example.sentiment].append(got == example.sentiment)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, test))
    total = sum(sum(v) for v in right.values()) / max(1, sum(len(v) for v in right.values()))
    return total, {label: round(sum(v) / max(1, len(v)), 2) for label, v in right.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default=None, help="the served model's id (default: the first in /models)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=600, help="metric calls, as optimize_demo.py's")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    model = args.model
    if model is None:
        import urllib.request

        with urllib.request.urlopen(f"{args.base_url}/models") as reply:
            model = json.load(reply)["data"][0]["id"]
    lm = dspy.LM(f"openai/{model}", api_base=args.base_url, api_key="sk-none", temperature=0.0, max_tokens=64,
                 cache=False)
    reflection = dspy.LM(f"openai/{model}", api_base=args.base_url, api_key="sk-none", temperature=0.7,
                         max_tokens=256, cache=False)
    dspy.configure(lm=lm)
    train, val, test = split("train"), split("validation"), split("test")
    before, before_labels = test_score(dspy.Predict(Classify), test, args.threads)
    print(f"DSPy {dspy.__version__}, {model}: test before {before:.3f} {before_labels}", flush=True)
    for seed in args.seeds:
        started = time.perf_counter()
        optimizer = dspy.GEPA(metric=metric, max_metric_calls=args.budget, reflection_lm=reflection, seed=seed,
                              num_threads=args.threads, track_stats=False)
        program = optimizer.compile(dspy.Predict(Classify), trainset=train, valset=val)
        trained = time.perf_counter() - started
        after, labels = test_score(program, test, args.threads)
        instruction = program.signature.instructions
        print(f"seed {seed}: test {before:.3f} -> {after:.3f} {labels}; training {trained:.0f} s; "
              f"instruction: {instruction[:200]!r}", flush=True)


if __name__ == "__main__":
    main()
