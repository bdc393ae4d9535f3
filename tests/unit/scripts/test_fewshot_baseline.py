"""The few-shot baseline's parts on a scripted model: which demonstrations it draws (train split only, balanced
when asked), and the accuracy, per-label scores and answers it reports."""

from __future__ import annotations

from collections import Counter

from app.examples.datasets import load_split
from app.pipeline.resources.types import LLMRequest
from scripts.fewshot_baseline import draw_demos, fewshot_rows, table
from tests.support.fakes import ScriptedLM


def test_draws_are_seeded_from_train_and_balanced_when_asked() -> None:
    train = load_split("sentiment3", "train")
    inputs = {e["input"] for e in train}
    balanced = draw_demos(train, 6, 0, "balanced")
    assert Counter(d["output"] for d in balanced) == {"positive": 2, "negative": 2, "neutral": 2}
    assert {d["input"] for d in balanced} <= inputs
    assert draw_demos(train, 3, 1, "random") == draw_demos(train, 3, 1, "random") != draw_demos(train, 3, 2, "random")


async def test_rows_report_accuracy_per_label_and_the_answers() -> None:
    truth = {e["input"]: e["target"] for e in load_split("sentiment3", "test")}

    def reply(alias: str, request: LLMRequest) -> str:
        if not isinstance(request.prompt, list):
            return "I think it is a fine review."  # no demonstrations: a sentence, as a chat model answers
        label = truth[request.prompt[-1]["content"]]
        return "positive" if label == "neutral" else label  # never says neutral

    rows = await fewshot_rows(ScriptedLM(reply), [0, 3], [0], draw="balanced", only=["positive", "neutral"])
    assert [(r.shots, r.seed) for r in rows] == [(0, None), (3, 0)]
    assert rows[0].accuracy == 0.0 and rows[0].answers == {"other": 50}
    assert rows[1].accuracy == 0.5 and rows[1].per_label == {"neutral": 0.0, "positive": 1.0}
    assert rows[1].answers == {"positive": 50} and len(rows[1].demos) == 3
    assert "| 3 | 0 | 0.500 | 0.00 | 1.00 | positive 50 |" in table(rows)
