"""The labelled datasets shipped with the example pipelines, in fixed train / validation / test splits.

* ``sentiment``: 300 product reviews written for this project, labelled ``positive`` or ``negative`` (150 each;
  splits 140 / 80 / 80, each balanced); the target is the label, the contract of the ``sentiment`` example.
* ``sentiment3``: a harder three-way task, 300 reviews labelled ``positive``, ``negative`` or ``neutral`` (100 each;
  splits 150 / 75 / 75, each balanced). Its positive and negative reviews are ``sentiment``'s and sit in the same
  split there, so no review is trained on in one task and tested on in the other.
* ``review-extract``: 180 reviews for the structured example, the target a ``ReviewFacts`` record
  (``{"sentiment": "positive"|"negative"|"mixed", "rating": 1-5, "would_recommend": bool}``, 60 per sentiment;
  splits 90 / 45 / 45, each balanced), scored field by field with the metric ``fields``.

Each line of ``<task>_<split>.jsonl`` is ``{"input": ..., "target": ...}``, the example format that
``POST /v1/trainings`` and ``POST /v1/evaluations`` take as ``dataset``; a request names one as
``"dataset": "sentiment:train"`` (see :func:`shipped_datasets`, which the registry serves). Train on ``train``,
choose on ``validation``, report on ``test``: demonstrations and prompts never see the other two.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

#: the shipped tasks (named like the pipelines they label) and the files that hold them
TASKS = {"sentiment": "sentiment", "sentiment3": "sentiment3", "review-extract": "review_extract"}
SPLITS = ("train", "validation", "test")


def load_split(task: str, split: str) -> list[dict[str, Any]]:
    """The examples of one split of a shipped dataset, in file order (a fresh list each call)."""
    return copy.deepcopy(list(_read(task, split)))  # the cache stays as read, whatever a caller changes


@functools.cache
def _read(task: str, split: str) -> tuple[dict[str, Any], ...]:
    if task not in TASKS:
        raise KeyError(f"no shipped dataset {task!r}; shipped: {', '.join(sorted(TASKS))}")
    if split not in SPLITS:
        raise KeyError(f"no split {split!r}; the splits are {', '.join(SPLITS)}")
    text = resources.files("app.examples").joinpath(f"{TASKS[task]}_{split}.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def labels(task: str) -> list[str]:
    """The classes of a task, for per-label scores: the target itself, or a record's ``sentiment``."""
    return sorted({label_of(example["target"]) for example in _read(task, "train")})


def label_of(target: Any) -> str:
    """The class an example belongs to (what the splits are balanced on)."""
    return str(target["sentiment"] if isinstance(target, dict) else target)


def shipped_datasets() -> dict[str, Callable[[], list[dict[str, Any]]]]:
    """``{"sentiment:train": loader, ...}``: every split by the name a request gives, loaded on first use."""
    return {f"{task}:{split}": functools.partial(load_split, task, split) for task in TASKS for split in SPLITS}
