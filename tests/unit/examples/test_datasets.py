"""The labelled datasets shipped with the examples: sizes, balance, clean splits, and that every example fits
its pipeline and its metric."""

from __future__ import annotations

from collections import Counter

import pytest

from app.examples.datasets import SPLITS, TASKS, label_of, labels, load_split, shipped_datasets
from app.examples.extract import Extract, ReviewFacts
from app.examples.sentiment import SentimentLabel
from app.jobs.graphs import trace_item
from app.pipeline.optimization import field_match

SIZES = {
    "sentiment": {"train": 140, "validation": 80, "test": 80},
    "sentiment3": {"train": 150, "validation": 75, "test": 75},
    "review-extract": {"train": 90, "validation": 45, "test": 45},
}
PIPELINES = {"sentiment": SentimentLabel, "sentiment3": SentimentLabel, "review-extract": Extract}
CLASSES = {"sentiment": 2, "sentiment3": 3, "review-extract": 3}


def _key(text: str) -> str:
    return " ".join(text.casefold().split())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_split_has_its_size_and_is_balanced_across_labels(task: str) -> None:
    classes = labels(task)
    assert len(classes) == CLASSES[task]
    for split in SPLITS:
        examples = load_split(task, split)
        assert len(examples) == SIZES[task][split]
        counts = Counter(label_of(e["target"]) for e in examples)
        assert set(counts) == set(classes) and len(set(counts.values())) == 1, (split, counts)
        assert all(set(e) == {"input", "target"} and isinstance(e["input"], str) and e["input"].strip()
                   for e in examples)


def test_no_input_repeats_within_or_across_splits_or_tasks() -> None:
    seen: dict[str, str] = {}
    for task in ("sentiment", "review-extract"):
        for split in SPLITS:
            for example in load_split(task, split):
                key = _key(example["input"])
                assert key not in seen, f"{task}:{split} repeats an input of {seen.get(key)}: {example['input']!r}"
                seen[key] = f"{task}:{split}"
    assert len(seen) == 480
    # the three-way task shares sentiment's positive and negative reviews, each in the same split there
    for split in SPLITS:
        for example in load_split("sentiment3", split):
            key = _key(example["input"])
            if example["target"] == "neutral":
                assert key not in seen, example
            else:
                assert seen[key] == f"sentiment:{split}", example


def test_targets_are_what_the_pipelines_and_metrics_expect() -> None:
    assert labels("sentiment") == ["negative", "positive"]  # the example's two-way contract
    assert labels("sentiment3") == ["negative", "neutral", "positive"]
    for split in SPLITS:
        for example in load_split("review-extract", split):
            facts = ReviewFacts.model_validate(example["target"])
            assert facts.model_dump(mode="json") == example["target"]
            assert field_match(example["target"], example["target"]) == (1.0, "")
            # the labels agree with each other: a positive review rates 4-5 and is recommended, a negative 1-2
            if facts.sentiment != "mixed":
                assert facts.would_recommend is (facts.sentiment == "positive")
                assert facts.rating in ((4, 5) if facts.sentiment == "positive" else (1, 2))
    for task, pipeline in PIPELINES.items():
        example = load_split(task, "train")[0]
        graph = trace_item(pipeline(), (example["input"],), {})
        assert [node.kind for node in graph.nodes.values()] == ["input", "llm"]


def test_loading_gives_fresh_lists_and_every_split_is_named() -> None:
    first = load_split("sentiment", "train")
    first[0]["target"] = "changed"
    assert load_split("sentiment", "train")[0]["target"] != "changed"
    loaders = shipped_datasets()
    assert sorted(loaders) == sorted(f"{task}:{split}" for task in TASKS for split in SPLITS)
    assert loaders["review-extract:test"]() == load_split("review-extract", "test")
    with pytest.raises(KeyError, match="shipped: review-extract, sentiment, sentiment3"):
        load_split("reviews", "train")
    with pytest.raises(KeyError, match="train, validation, test"):
        load_split("sentiment", "dev")
