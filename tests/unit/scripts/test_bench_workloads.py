"""Workload (e) of the engine benchmark (scripts/peers/workloads.py): English windows, deterministic, repeats."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.peers import workloads as w


def test_english_text_is_the_readme_prose_and_reviews() -> None:
    text = w.english_text()
    assert len(text) > 10_000
    assert "```" not in text and "\n|" not in text  # code fences and table rows left out
    assert "The battery lasts two days" in text  # an example review


def test_english_workload_shapes_and_determinism() -> None:
    ids = list(range(5000))  # stands in for the tokenized text: a window is then a run of consecutive ids
    first = w.english_workload(ids, seed=0)
    assert len(first) == w.E_REQUESTS
    for request in first:
        lo, hi = w.E_PROMPT_RANGE
        assert lo <= len(request.prompt_token_ids) <= hi
        assert w.E_OUTPUT_RANGE[0] <= request.max_tokens <= w.E_OUTPUT_RANGE[1]
        start = request.prompt_token_ids[0]
        assert list(request.prompt_token_ids) == list(range(start, start + len(request.prompt_token_ids)))
    assert w.english_workload(ids, seed=0) == first
    again = w.english_workload(ids, seed=0, repeat=1)  # same lengths, other windows
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in again] == [
        (len(r.prompt_token_ids), r.max_tokens) for r in first
    ]
    assert sum(a.prompt_token_ids != b.prompt_token_ids for a, b in zip(first, again, strict=True)) > 90


def test_build_workload_e_reads_the_ids_named_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(w.TEXT_IDS_ENV, raising=False)
    assert "e" not in w.available_workloads()
    with pytest.raises(RuntimeError, match=w.TEXT_IDS_ENV):
        w.build_workload("e")
    path = tmp_path / "ids.json"
    w.write_text_ids(path, list(range(1000, 3000)))
    monkeypatch.setenv(w.TEXT_IDS_ENV, str(path))
    assert w.available_workloads()[-1] == "e"
    assert w.build_workload("e") == w.english_workload(list(range(1000, 3000)))
