"""`inf-engine run` as a user runs it: real pipeline, real JSONL, a fake server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from app.testing.fake_llm_server import FakeLLMServer

runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[3] / "app" / "examples" / "reviews.jsonl"


@pytest.fixture
def resources_file(tmp_path: Path):
    with FakeLLMServer(latency=0.01) as server:
        path = tmp_path / "resources.toml"
        path.write_text(
            f'[endpoints.assistant]\nprovider = "openai"\nmodel = "m"\nbase_url = "{server.base_url}"\n'
            'api_key = "sk-x"\n'
        )
        yield path


def test_run_writes_one_result_per_item(resources_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run", "review-compare", "--input", str(EXAMPLE), "--output", str(out),
                                 "--resources", str(resources_file)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12
    assert {r["custom_id"] for r in rows} == {f"review-{i}" for i in range(1, 13)}
    assert all(r["status"] == "completed" and set(r["output"]) == {"liked", "disliked", "verdict"} for r in rows)


def test_run_with_module_path_and_stdout(resources_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"custom_id": "a", "input": "one review"}\n"a bare string"\n')
    result = runner.invoke(app, ["run", "app.examples.review_compare:ReviewCompare", "--input", str(data),
                                 "--resources", str(resources_file)])
    assert result.exit_code == 0, result.output
    ids = sorted(json.loads(line)["custom_id"] for line in result.stdout.splitlines() if line.startswith("{"))
    assert ids == ["2", "a"]


@pytest.mark.parametrize(
    ("content", "pipeline", "message"),
    [
        (None, "review-compare", "does not exist"),
        ('{"input": "x"}\n{not json\n', "review-compare", "line 2 is not valid JSON"),
        ('{"custom_id": "a", "input": "x"}\n{"custom_id": "a", "input": "y"}\n', "review-compare", "duplicate"),
        ('{"input": "x"}\n', "no.such.module:Pipeline", "unknown pipeline"),
        ('{"input": "x"}\n', "not-a-path", "unknown pipeline"),
        ('{"input": "x"}\n', "app.examples.review_compare:Parameter", "not a pipeline"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path, content: str | None, pipeline: str, message: str) -> None:
    data = tmp_path / "in.jsonl"
    if content is not None:
        data.write_text(content)
    result = runner.invoke(app, ["run", pipeline, "--input", str(data)])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_resources_file_is_exit_code_2(tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"input": "x"}\n')
    result = runner.invoke(app, ["run", "review-compare", "--input", str(data), "--resources", str(tmp_path / "no.toml")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
