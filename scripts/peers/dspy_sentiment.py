"""DSPy's GEPA on the `sentiment` example's shipped splits, as a peer of scripts/optimize_demo.py: the same model
(served by our own OpenAI-compatible server), the same data, the same budget in metric calls, the same exact-match
metric, held-out test accuracy before and after.

DSPy runs in its own virtual environment (it pins its own dependencies); this file imports nothing of ours:

    python3.11 -m venv .venv-dspy && .venv-dspy/bin/pip install dspy
    .venv/bin/inf-engine serve --port 8011 &                 # SmolLM2-135M, the default model
    .venv-dspy/bin/python scripts/peers/dspy_sentiment.py --base-url http://127.0.0.1:8011/v1 --seeds 0 1 2

The program is one ``dspy.Predict`` whose instruction starts as our pipeline's ("You read product reviews.").
``--optimizers gepa`` evolves the instruction with the same model as its reflection LM (``max_metric_calls`` is
the budget); ``mipro`` is MIPROv2 (bootstrapped and labelled demonstrations x proposed instructions, the same model
proposing), its trials sized so that its metric calls come near the budget; ``bootstrap`` is
BootstrapFewShotWithRandomSearch (demonstrations only: as many candidate programs as the budget pays to validate).
All choose on the validation split;
the test split is scored before and after. Metric calls are counted as they happen, so the figures compare real
spending. Per-label accuracy shows whether a score is learning or one repeated label. ``--json`` prints one JSON
object per training on standard output (``optimize_demo.py --dspy-python`` reads them) and the log on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dspy  # type: ignore[import-not-found]

EXAMPLES = Path(__file__).resolve().parents[2] / "app" / "examples"
LABELS = ("positive", "negative")
MAX_ERRORS = 1_000_000  # an answer DSPy cannot parse scores 0 (as in our metric); it must not stop the training


def split(name: str) -> list[Any]:
    rows = [json.loads(line) for line in (EXAMPLES / f"sentiment_{name}.jsonl").read_text().splitlines() if line]
    return [dspy.Example(review=r["input"], sentiment=r["target"]).with_inputs("review") for r in rows]


class Classify(dspy.Signature):  # type: ignore[misc]
    """You read product reviews."""

    review: str = dspy.InputField()
    sentiment: str = dspy.OutputField(desc="exactly one word: positive or negative")


def answer(pred: Any) -> str:
    return str(getattr(pred, "sentiment", "") or "").strip().lower()


class Counted:
    """The metric, counting its calls (thread-safe: DSPy evaluates on a pool)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def _count(self) -> None:
        with self.lock:
            self.calls += 1

    def gepa(self, gold: Any, pred: Any, trace: Any = None, pred_name: Any = None, pred_trace: Any = None) -> Any:
        """GEPA's metric: a score with feedback for the reflection LM."""
        self._count()
        got = answer(pred)
        ok = got == gold.sentiment
        feedback = "Correct." if ok else f"The answer must be exactly {gold.sentiment!r}, with nothing else; got {got!r}."
        return dspy.Prediction(score=float(ok), feedback=feedback)

    def plain(self, gold: Any, pred: Any, trace: Any = None) -> float:
        """MIPROv2's metric: the same exact match, as a number."""
        self._count()
        return float(answer(pred) == gold.sentiment)


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


def compile_program(kind: str, seed: int, budget: int, threads: int, reflection: Any, counted: Counted,
                    train: list[Any], val: list[Any]) -> Any:
    student = dspy.Predict(Classify)
    if kind == "gepa":
        optimizer = dspy.GEPA(metric=counted.gepa, max_metric_calls=budget, reflection_lm=reflection, seed=seed,
                              num_threads=threads, track_stats=False)
        return optimizer.compile(student, trainset=train, valset=val)
    if kind == "bootstrap":  # demonstrations only: each candidate program is scored on the whole validation set
        # after the zero-shot, labelled-only and unshuffled programs; about 40 calls go to bootstrapping
        programs = max(1, (budget - 40) // len(val) - 3)
        search = dspy.BootstrapFewShotWithRandomSearch(
            metric=counted.plain, max_bootstrapped_demos=4, max_labeled_demos=4, num_candidate_programs=programs,
            num_threads=threads, max_errors=MAX_ERRORS)
        return search.compile(student, trainset=train, valset=val)
    # MIPROv2: one full validation, then minibatches of 8 with a full validation every 5 trials
    minibatch, every = 8, 5
    trials = max(1, int((budget - len(val)) / (minibatch + len(val) / every)))
    mipro = dspy.MIPROv2(metric=counted.plain, prompt_model=reflection, auto=None, num_candidates=6,
                         num_threads=threads, seed=seed, max_bootstrapped_demos=4, max_labeled_demos=4,
                         verbose=False, track_stats=False, max_errors=MAX_ERRORS)
    return mipro.compile(student, trainset=train, valset=val, num_trials=trials, minibatch_size=minibatch,
                         minibatch_full_eval_steps=every, requires_permission_to_run=False)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default=None, help="the served model's id (default: the first in /models)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizers", nargs="+", choices=("gepa", "mipro", "bootstrap"), default=["gepa"])
    parser.add_argument("--budget", type=int, default=600, help="metric calls, as optimize_demo.py's")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="one JSON object per training on stdout")
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
    log(f"DSPy {dspy.__version__}, {model}: test before {before:.3f} {before_labels}")
    for kind in args.optimizers:
        for seed in args.seeds:
            counted = Counted()
            started = time.perf_counter()
            try:
                program = compile_program(kind, seed, args.budget, args.threads, reflection, counted, train, val)
            except Exception as exc:  # a peer that cannot train is a row with its reason
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                log(f"{kind} seed {seed}: failed after {counted.calls} metric calls: {reason}")
                if args.json:
                    print(json.dumps({"optimizer": kind, "seed": seed, "before": before, "error": reason,
                                      "metric_calls": counted.calls, "dspy": dspy.__version__}), flush=True)
                continue
            trained = time.perf_counter() - started
            after, labels = test_score(program, test, args.threads)
            instruction = program.signature.instructions
            demos = len(getattr(program, "demos", []) or [])
            log(f"{kind} seed {seed}: test {before:.3f} -> {after:.3f} {labels}; {counted.calls} metric calls; "
                f"{demos} demos; training {trained:.0f} s; instruction: {instruction[:200]!r}")
            if args.json:
                print(json.dumps({
                    "optimizer": kind, "seed": seed, "before": before, "after": after, "before_labels": before_labels,
                    "after_labels": labels, "metric_calls": counted.calls, "demos": demos,
                    "train_seconds": trained, "instruction": instruction, "dspy": dspy.__version__,
                }), flush=True)


if __name__ == "__main__":
    main()
