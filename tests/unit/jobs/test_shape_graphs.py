"""One trace per input shape: an item's graph is its shape's with the item's inputs bound, exactly what tracing
the item makes; a pipeline whose graph depends on its inputs' values is traced item by item."""

from __future__ import annotations

from typing import Any

from app.jobs.graphs import ShapeGraphs, load_module, trace_item, with_inputs
from app.pipeline import LLMInference, Module
from tests.support.pipeline_modules import FanOut


class ByValue(Module):
    """Calls one endpoint or the other depending on the text itself."""

    def __init__(self) -> None:
        super().__init__()
        self.short = LLMInference("fast", system_prompt="Short.")
        self.long = LLMInference("fast", system_prompt="Long.")

    def forward(self, text: Any) -> Any:
        return self.short(text) if len(str(text.payload)) < 10 else self.long(text)


def test_binding_an_items_inputs_makes_what_tracing_it_makes() -> None:
    for module, first, second in [
        (FanOut(), ("one text",), ("another, longer text",)),
        (load_module("review-compare"), ({"review": "good"},), ({"review": "bad battery, great screen"},)),
    ]:
        template = trace_item(module, first, {})
        bound = with_inputs(template, second, {})
        assert bound is not None
        assert bound.to_dict() == trace_item(module, second, {}).to_dict()
        assert template.to_dict() == trace_item(module, first, {}).to_dict()  # the template is left as it was


def test_items_of_a_shape_after_the_second_are_bound_not_traced(monkeypatch: Any) -> None:
    traced: list[Any] = []
    real = trace_item

    def counting(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        traced.append(args)
        return real(module, args, kwargs)

    monkeypatch.setattr("app.jobs.graphs.trace_item", counting)
    shapes, module = ShapeGraphs(), FanOut()
    graphs = [shapes.graph("job", module, (f"text {i}",), {}) for i in range(5)]
    assert len(traced) == 2  # the first item, and the second to check that binding makes the same
    for i, graph in enumerate(graphs):
        assert graph.to_dict() == real(module, (f"text {i}",), {}).to_dict()
    shapes.graph("job", module, ({"a": 1},), {})  # another shape is traced
    shapes.graph("other job", module, ("text",), {})  # so is another job's item
    assert len(traced) == 4


def test_a_graph_that_depends_on_input_values_is_traced_item_by_item(monkeypatch: Any) -> None:
    traced: list[Any] = []
    real = trace_item

    def counting(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        traced.append(args)
        return real(module, args, kwargs)

    monkeypatch.setattr("app.jobs.graphs.trace_item", counting)
    shapes, module = ShapeGraphs(), ByValue()
    texts = ["tiny", "a much longer text", "small", "another long text here"]
    graphs = [shapes.graph("job", module, (t,), {}) for t in texts]
    assert len(traced) == 4
    for text, graph in zip(texts, graphs, strict=True):
        assert graph.to_dict() == real(module, (text,), {}).to_dict()
