"""The selection-gated optimizer with a scripted classifier: demonstrations and rewrites are accepted only when they
beat their parent by more than the noise, the Pareto front's bookkeeping, demonstrations from the training split
only, the metric-call budget, a validation score that never falls, and seeded repeatability."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from app.examples.sentiment import SentimentLabel
from app.pipeline.optimization import ParetoFront, SelectionOptimizer, SelectionResult, VerifierLoss, gate
from app.pipeline.resources.types import LLMRequest
from tests.unit.pipeline.optimization.conftest import AliasLM

LABELS = {"good": "positive", "bad": "negative"}
GOOD_PROMPT = "Answer in ONE WORD."


def dataset(start: int, count: int) -> list[dict[str, str]]:
    words = ["good", "bad"]
    return [{"input": f"item {i} {words[i % 2]}", "target": LABELS[words[i % 2]]} for i in range(start, start + count)]


TRAIN = dataset(0, 16)
VAL = dataset(100, 8)

Helps = Callable[[int, int], bool]  # (example number, demonstrations shown) -> answers right


def graded(number: int, shown: int) -> bool:
    """More demonstrations, more examples right: 1 shown gets a quarter, 4 or more get all."""
    return number % 4 < shown


def classifier(helps: Helps) -> Callable[[LLMRequest], str]:
    def answer(request: LLMRequest) -> str:
        turns = request.prompt if isinstance(request.prompt, list) else [{"role": "user", "content": request.prompt}]
        text = str(turns[-1]["content"])
        _, number, word = text.split()
        shown = sum(1 for t in turns[:-1] if t["role"] == "user")
        if GOOD_PROMPT in str(request.system_prompt) or helps(int(number), shown):
            return LABELS[word]
        return "I think it is fine."
    return answer


def exact(output: Any, target: str) -> tuple[bool, str]:
    ok = str(output).strip() == target
    return ok, "" if ok else f"The answer must be exactly {target!r}."


def lm(helps: Helps = graded, updater: str = GOOD_PROMPT) -> AliasLM:
    return AliasLM({"assistant": classifier(helps), "optimizer/updater": lambda r: updater,
                    "optimizer/aggregator": lambda r: "Answer with the label only."})


async def fit(fake: AliasLM, *, train: list[Any] = TRAIN, val: list[Any] = VAL, **options: Any) -> SelectionResult:
    settings: dict[str, Any] = {"budget": 300, "minibatch_size": 8, "candidates_per_step": 3, "seed": 0,
                                "rewrite_instructions": False, **options}
    optimizer = SelectionOptimizer(SentimentLabel(), VerifierLoss(exact), **settings)
    return await optimizer.fit(train, val, resources=fake)


async def test_demonstrations_that_beat_the_parent_are_accepted_and_come_from_the_training_split_only() -> None:
    fake = lm()
    result = await fit(fake)
    seed = result.candidates[0]
    assert seed.kind == "seed" and seed.val_score == 0.0 and seed.accepted
    assert result.best.val_score is not None and result.best.val_score >= 0.75
    assert any(c.accepted and c.kind == "demos" for c in result.candidates[1:])
    assert result.final_state == result.best.state and result.final_state["classify.demos"]
    train_inputs = {e["input"] for e in TRAIN}
    for candidate in result.candidates:
        assert {d["input"] for d in candidate.state["classify.demos"]} <= train_inputs
    for alias, request in fake.requests:  # no validation input is ever shown as a demonstration
        if alias == "assistant" and isinstance(request.prompt, list):
            assert {str(t["content"]) for t in request.prompt[:-1] if t["role"] == "user"} <= train_inputs


async def test_a_gain_within_the_noise_is_rejected_and_the_starting_parameters_stay() -> None:
    # demonstrations help one example in eight: a minibatch of all eight sees a gain of 1/8 with a noise of 1/8
    result = await fit(lm(lambda number, shown: shown > 0 and number % 8 == 0), train=TRAIN[:8])
    children = result.candidates[1:]
    assert children and all(not c.accepted for c in children)
    assert all(c.gain is not None and c.noise is not None and c.gain <= c.noise for c in children if c.scores)
    assert all(c.note.startswith("rejected") for c in children if c.scores)
    assert result.best is result.candidates[0] and result.final_state == result.initial_state


def test_the_gate_is_the_mean_paired_gain_against_its_standard_error() -> None:
    gain, noise = gate([1, 1, 0, 0, 0, 0, 0, 0], [0] * 8, 1.0)
    assert gain == 0.25 and gain > noise  # two wins, no loss: accepted
    gain, noise = gate([1, 0, 0, 0, 0, 0, 0, 0], [0] * 8, 1.0)
    assert gain == pytest.approx(noise)  # one win is within the noise
    gain, noise = gate([1, 1, 1, 0], [0, 0, 0, 1], 1.0)
    assert gain == 0.5 and noise == pytest.approx(0.5)  # three wins and a loss on four: not enough
    assert gate([1, 1], [0, 0], 1.0) == (1.0, 0.0)  # every example better by the same: no spread


async def test_an_instruction_rewritten_from_feedback_is_accepted_when_it_wins() -> None:
    result = await fit(lm(lambda number, shown: False), rewrite_instructions=True, demonstrations=False)
    (rewrite, *_) = [c for c in result.candidates if c.kind == "instruction"]
    assert rewrite.parent == 0 and rewrite.changed == ["classify.system_prompt"] and rewrite.accepted
    assert rewrite.minibatch_score == 1.0 and rewrite.parent_minibatch_score == 0.0
    assert result.best is rewrite and result.final_state == {"classify.system_prompt": GOOD_PROMPT}


async def test_the_loop_stops_once_every_validation_example_passes() -> None:
    fake = lm(lambda number, shown: False)
    result = await fit(fake, budget=600, rewrite_instructions=True, demonstrations=False)
    assert result.best.val_score == 1.0 and result.stopped == "perfect"
    assert result.metric_calls < 60  # the starting validation, one step and the winner's validation: not the budget


async def test_the_budget_counts_every_example_scored_and_stops_before_it_is_exceeded() -> None:
    fake = lm(lambda number, shown: number % 4 < min(shown, 2))  # never perfect: only the budget stops it
    result = await fit(fake, budget=60, minibatch_size=4)
    assistant_calls = sum(1 for alias, _ in fake.requests if alias == "assistant")
    assert result.metric_calls == assistant_calls <= 60 and result.stopped == "budget"
    with pytest.raises(ValueError, match="budget"):
        await fit(lm(), budget=10)  # cannot even validate the starting parameters and take a step


async def test_the_best_validation_score_never_falls_and_the_module_ends_on_the_best() -> None:
    result = await fit(lm(), budget=500)
    scores = [s for s in result.best_val_scores if s is not None]
    assert scores == sorted(scores) and scores[-1] > scores[0]
    bests = [c.val_score for c in result.candidates if c.best]
    assert bests == sorted(set(bests)), "each new best strictly beats the one before"
    assert max(c.val_score or 0.0 for c in result.candidates) == result.best.val_score


async def test_a_seed_repeats_a_run_exactly_and_another_seed_draws_differently() -> None:
    first, again = await fit(lm(), seed=3), await fit(lm(), seed=3)
    assert [c.to_dict() for c in first.candidates] == [c.to_dict() for c in again.candidates]
    other = await fit(lm(), seed=4)
    assert [c.minibatch for c in other.candidates] != [c.minibatch for c in first.candidates]


def test_pareto_front_keeps_the_winners_of_each_example_and_drops_the_dominated() -> None:
    front = ParetoFront(4)
    front.add(0, [0, 0, 0, 0])  # wins everything while alone (ties count)
    front.add(1, [1, 1, 0, 0])
    front.add(2, [0, 0, 1, 0])
    front.add(3, [1, 0, 0, 0])  # wins only example 0, which 1 wins too: dominated
    assert front.best == [1, 1, 1, 0]
    assert front.winners == [{1, 3}, {1}, {2}, {0, 1, 2, 3}]
    means = {0: 0.0, 1: 0.5, 2: 0.25, 3: 0.25}
    assert front.frontier(means) == {1: 3, 2: 2}
    rng = random.Random(0)
    picks = [front.choose(rng, means) for _ in range(2000)]
    assert set(picks) == {1, 2} and 0.5 < picks.count(1) / len(picks) < 0.7  # 3 wins against 2
    with pytest.raises(ValueError):
        front.add(4, [1.0])
