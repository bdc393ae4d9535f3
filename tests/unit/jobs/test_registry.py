"""The operator's registry: shipped examples, entry points and listed modules; an unregistered name is refused
with the list of registered ones, and nothing is imported for it."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from app.jobs.registry import (
    RegistryError,
    UnknownNameError,
    UnknownPipelineError,
    build_registry,
    configure_registry,
    load_local_pipeline,
    load_pipeline_class,
)


@pytest.fixture
def operator_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "op_listed.py").write_text(
        "from app.pipeline import Module\n"
        "class Shout(Module):\n    def forward(self, text):\n        return text\n"
        "METRICS = {'always': lambda output, target: (True, '')}\n"
        "LOSSES = {'none': lambda: None}\n"
        "DATASETS = {'mine': [{'input': 'a', 'target': 'b'}], 'lazy': lambda: [{'input': 'c'}]}\n"
    )
    (tmp_path / "op_named.py").write_text(
        "from app.pipeline import Module\n"
        "class Hidden(Module):\n    def forward(self, text):\n        return text\n"
        "PIPELINES = {'whisper': Hidden}\n"
    )
    (tmp_path / "op_side_effect.py").write_text(f"open({str(tmp_path / 'marker')!r}, 'w').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_listed_modules_register_their_pipelines_losses_and_metrics(operator_modules: Path) -> None:
    registry = build_registry(["op_listed", "op_named"])
    assert registry.pipeline_names() == ["op_listed:Shout", "review-compare", "review-extract", "sentiment", "whisper"]
    assert registry.pipeline_path("whisper") == "op_named:Hidden"
    assert registry.pipeline_path("op_named:Hidden") == "op_named:Hidden"  # a registered class by its path
    assert registry.pipeline_path("sentiment") == "app.examples.sentiment:SentimentLabel"
    assert callable(registry.metric("always")) and registry.loss("none")() is None
    with pytest.raises(UnknownNameError, match="unknown metric 'os:system': registered metrics: always"):
        registry.metric("os:system")
    with pytest.raises(UnknownNameError, match="registered losses: none"):
        registry.loss("nope")
    assert registry.dataset("mine") == [{"input": "a", "target": "b"}] and registry.dataset("lazy") == [{"input": "c"}]
    assert len(registry.dataset("sentiment:test")) == 80  # the shipped splits are registered beside them
    with pytest.raises(UnknownNameError, match="unknown dataset '/etc/passwd': registered datasets: lazy, mine"):
        registry.dataset("/etc/passwd")


def test_an_unregistered_pipeline_is_refused_without_importing(operator_modules: Path) -> None:
    configure_registry(["op_listed"])
    try:
        for name in ("op_side_effect:X", "op_side_effect", "this:s", 42):
            with pytest.raises(UnknownPipelineError, match="registered: op_listed:Shout, review-compare, review-extract, sentiment"):
                load_pipeline_class(name)  # type: ignore[arg-type]
        assert "op_side_effect" not in sys.modules and not (operator_modules / "marker").exists()
        assert load_pipeline_class("op_listed:Shout").__name__ == "Shout"
    finally:
        configure_registry(None)
    # the local CLI runs the user's own code: any path works there
    assert type(load_local_pipeline("op_named:Hidden")).__name__ == "Hidden"


def test_entry_points_register_names_and_load_on_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = {
        "inf_engine.pipelines": [metadata.EntryPoint("reviews", "app.examples.review_compare:ReviewCompare",
                                                     "inf_engine.pipelines")],
        "inf_engine.metrics": [metadata.EntryPoint("starts", "app.jobs.learning.specs:make_check", "inf_engine.metrics")],
        "inf_engine.losses": [],
        "inf_engine.datasets": [],
    }

    def entry_points(group: str) -> list[Any]:
        return groups[group]

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    registry = build_registry()
    assert registry.pipeline_path("reviews") == "app.examples.review_compare:ReviewCompare"
    from app.jobs.learning.specs import make_check

    assert registry.metric("starts") is make_check


def test_a_listed_module_that_does_not_import_is_an_operator_error() -> None:
    with pytest.raises(RegistryError, match="INF_ENGINE_PIPELINE_MODULES lists 'no_such_module_xyz'"):
        build_registry(["no_such_module_xyz"])


def test_internal_pipelines_resolve_under_their_old_paths_too() -> None:
    registry = build_registry()
    new = "app.jobs.batches.pipeline:BatchRequest"
    assert registry.pipeline_path(new) == new
    assert registry.pipeline_path("app.jobs.batch_pipeline:BatchRequest") == new
    assert new not in registry.pipeline_names()  # accepted, never listed


def test_a_stored_state_with_attached_demonstrations_loads_into_the_registered_pipeline() -> None:
    from app.jobs.graphs import load_module, trace_item

    demos = [{"input": "Broke in a week.", "output": "negative"}]
    state = {"classify.system_prompt": "Label it.", "classify.demos": demos}
    module = load_module("sentiment", state)  # as a worker loads the active version before running a node
    assert module.state_dict() == state
    (node,) = [n for n in trace_item(module, ("Fine.",), {}).nodes.values() if n.kind == "llm"]
    assert node.config()["demos"] == demos
    with pytest.raises(UnknownPipelineError, match="do not fit its current code"):
        load_module("sentiment", {"classify.examples": demos})
