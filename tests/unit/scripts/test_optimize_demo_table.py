"""The optimize demo's table puts our trainings and DSPy's side by side, failures included."""

from __future__ import annotations

from typing import Any

from scripts.optimize_demo import table


def ours(seed: int, after: float) -> dict[str, Any]:
    return {"seed": seed, "before": 0.0, "after": after, "after_labels": {"negative": after, "positive": after},
            "val": [0.0, 0.5, after], "accepted": 2, "candidates": 9, "kinds": ["demos"], "metric_calls": 600,
            "train_seconds": 70.0}


def test_the_table_sets_dspy_beside_ours() -> None:
    peers = [
        {"optimizer": "gepa", "seed": 0, "before": 0.075, "after": 0.475, "after_labels": {"positive": 0.95,
         "negative": 0.0}, "metric_calls": 600, "demos": 0, "train_seconds": 540.0, "dspy": "3.4.1"},
        {"optimizer": "mipro", "seed": 0, "before": 0.075, "error": "AdapterParseError: no proposed_instruction",
         "metric_calls": 31, "dspy": "3.4.1"},
    ]
    lines = table([ours(0, 0.9), ours(1, 0.8)], peers).splitlines()
    assert lines[0].startswith("| trainer | seed | test before | test after | gain | negative after | positive after")
    assert "| inf-engine selection | 0 | 0.000 | 0.900 | +0.900 | 0.90 | 0.90 | 600 | 70 |" in lines[2]
    mean = next(line for line in lines if line.startswith("| **inf-engine selection mean**"))
    assert "| 0.850 | +0.850 ± 0.071 |" in mean and "worst seed +0.800" in mean
    assert any(line.startswith("| **DSPy gepa mean** | | 0.075 | 0.475 | +0.400 |") for line in lines)
    gepa = next(line for line in lines if line.startswith("| DSPy 3.4.1 gepa | 0 |"))
    assert "| 0.00 | 0.95 | 600 | 540 | 0 demonstrations |" in gepa  # labels in our column order
    failed = next(line for line in lines if line.startswith("| DSPy 3.4.1 mipro | 0 |"))
    assert "failed" in failed and "AdapterParseError" in failed and "| 31 |" in failed
    assert not any("DSPy mipro mean" in line for line in lines)  # no mean of a failure
