"""Value-driven tracing: input nodes, node ids and dependencies, composites traced through, f-strings."""

from __future__ import annotations

from typing import Any

import pytest

import app.pipeline.functional as F
from app.pipeline import (
    LLMInference,
    Module,
    ModuleList,
    Parameter,
    Sequential,
    Tracer,
    Value,
    ValueKind,
    ValueRef,
    get_active_tracer,
    run,
    trace,
)
from app.pipeline.graph import InputNode
from tests.support.fakes import ScriptedResources


class Echo(Module):
    """A plain-Python leaf: recorded as one node, its forward runs at execution time on payloads."""

    def forward(self, x: Any, **kwargs: Any) -> Any:
        return x


class Two(Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = LLMInference("fast")
        self.second = LLMInference("smart", system_prompt="check")

    def forward(self, x: Value) -> Value:
        return self.second(self.first(x))


class Fanout(Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = LLMInference("a")
        self.b = LLMInference("b")
        self.merge = LLMInference("m")

    def forward(self, x: Value) -> Value:
        return self.merge(F.concat(self.a(x), self.b(x), sep="\n"))


class TestInputs:
    def test_positional_inputs(self) -> None:
        graph = Tracer().trace_values(Two(), "hello")
        assert graph.input_ids == ["input:input_0"]
        node = graph.nodes["input:input_0"]
        assert isinstance(node.module, InputNode)
        assert node.module.value is not None and node.module.value.payload == "hello"
        assert node.dependencies == []

    def test_several_positional_inputs(self) -> None:
        class Join(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("fast")

            def forward(self, a: Value, b: Value) -> Value:
                return self.llm(F.concat(a, b))

        graph = trace(Join(), "x", "y")
        assert graph.input_ids == ["input:input_0", "input:input_1"]

    def test_dict_and_kwarg_inputs_are_named_by_key(self) -> None:
        seen: dict[str, Any] = {}

        class Keys(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("fast")

            def forward(self, data: dict[str, Value], *, style: Value) -> Value:
                seen["data"], seen["style"] = data, style
                return self.llm(F.concat(data["q"], data["ctx"], style))

        graph = trace(Keys(), {"q": "question", "ctx": "context"}, style="terse")
        assert graph.input_ids == ["input:input_q_0", "input:input_ctx_1", "input:input_style_2"]
        assert seen["data"]["q"].ref == "input:input_q_0"
        assert seen["style"].ref == "input:input_style_2"
        assert seen["style"].payload == "terse"

    def test_nested_dict_keys_keep_the_outer_key(self) -> None:
        graph = trace(Echo(), {"outer": {"inner": 1}})
        assert graph.input_ids == ["input:input_outer_inner_0"]

    def test_input_values_keep_kind_and_meta(self) -> None:
        seen: list[Value] = []

        class Spy(Module):
            is_leaf = False

            def forward(self, x: Value) -> Value:
                seen.append(x)
                return x

        trace(Spy(), Value(ValueKind.STRUCTURED, {"a": 1}, meta={"source": "test"}))
        assert seen[0].kind is ValueKind.STRUCTURED
        assert seen[0].meta == {"source": "test"}
        assert seen[0].ref == "input:input_0"

    def test_tracer_is_only_active_inside_a_trace(self) -> None:
        active: list[Any] = []

        class Spy(Module):
            is_leaf = False

            def forward(self, x: Value) -> Value:
                active.append(get_active_tracer())
                return x

        tracer = Tracer()
        tracer.trace_values(Spy(), "x")
        assert active == [tracer]
        assert get_active_tracer() is None


class TestNodes:
    def test_node_ids_and_dependencies(self) -> None:
        graph = trace(Two(), "x")
        assert list(graph.nodes) == ["input:input_0", "LLMInference_1", "LLMInference_2"]
        assert graph.nodes["LLMInference_1"].dependencies == ["input:input_0"]
        assert graph.nodes["LLMInference_2"].dependencies == ["LLMInference_1"]
        assert graph.output_ids == ["LLMInference_2"]
        assert graph.output_structure == "LLMInference_2"

    def test_node_metadata(self) -> None:
        m = Two()
        graph = trace(m, "x")
        node = graph.nodes["LLMInference_2"]
        assert node.module is m.second
        assert node.module_name == "LLMInference"
        assert node.module_path == "second"
        assert node.priority == 0
        assert node.args == (ValueRef("LLMInference_1"),)
        assert node.kwargs == {}

    def test_counter_is_shared_by_modules_and_ops(self) -> None:
        graph = trace(Fanout(), "x")
        ids = [n for n in graph.nodes if not n.startswith("input:")]
        assert ids == ["LLMInference_1", "LLMInference_2", "F.concat_3", "LLMInference_4"]
        assert graph.nodes["F.concat_3"].dependencies == ["LLMInference_1", "LLMInference_2"]
        assert graph.nodes["LLMInference_4"].dependencies == ["F.concat_3"]

    def test_class_name_is_used_for_custom_leaves(self) -> None:
        class Holder(Module):
            def __init__(self) -> None:
                super().__init__()
                self.echo = Echo()

            def forward(self, x: Value) -> Value:
                return self.echo(self.echo(x))

        graph = trace(Holder(), "x")
        assert [n for n in graph.nodes if not n.startswith("input:")] == ["Echo_1", "Echo_2"]

    def test_kwargs_dependencies_and_literals(self) -> None:
        class Holder(Module):
            def __init__(self) -> None:
                super().__init__()
                self.echo = Echo()
                self.llm = LLMInference("fast")

            def forward(self, x: Value) -> Value:
                return self.echo("literal", other=self.llm(x), flag=True)

        graph = trace(Holder(), "x")
        node = graph.nodes["Echo_2"]
        assert node.dependencies == ["LLMInference_1"]
        assert node.args == ("literal",)
        assert node.kwargs == {"other": ValueRef("LLMInference_1"), "flag": True}

    def test_parameters_are_not_dependencies(self) -> None:
        class WithPrompt(Module):
            def __init__(self) -> None:
                super().__init__()
                self.prompt = Parameter("Answer briefly: ", description="instruction")
                self.llm = LLMInference("fast")

            def forward(self, x: Value) -> Value:
                return self.llm(F.concat(self.prompt, x))

        m = WithPrompt()
        graph = trace(m, "x")
        concat = graph.nodes["F.concat_1"]
        assert concat.dependencies == ["input:input_0"]
        assert graph.parameters["prompt"] is m.prompt
        assert graph.parameters["llm.system_prompt"] is m.llm.system_prompt
        stored = concat.args[0]
        assert isinstance(stored, Value) and stored.ref == "param:prompt" and stored.payload == "Answer briefly: "

    async def test_parameter_arguments_serialise_and_run(self, resources: ScriptedResources) -> None:
        class WithPrompt(Module):
            def __init__(self) -> None:
                super().__init__()
                self.prompt = Parameter("Answer: ", description="instruction")
                self.llm = LLMInference("fast")

            def forward(self, x: Value) -> Any:
                return {"op": self.llm(F.concat(self.prompt, x)), "direct": self.llm(self.prompt)}

        graph = trace(WithPrompt(), "q")
        assert "param:prompt" in graph.to_json()
        assert graph.compute_hash() == trace(WithPrompt(), "other").compute_hash()
        assert await run(WithPrompt(), "q", resources=resources) == {"op": "fast(Answer: q)", "direct": "fast(Answer: )"}

    def test_priority_attribute_is_recorded(self) -> None:
        class Urgent(LLMInference):
            priority = -5

        class Holder(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = Urgent("fast")

            def forward(self, x: Value) -> Value:
                return self.llm(x)

        assert trace(Holder(), "x").nodes["Urgent_1"].priority == -5

    def test_leaf_root_is_one_node(self) -> None:
        graph = trace(LLMInference("fast"), "x")
        assert list(graph.nodes) == ["input:input_0", "LLMInference_1"]
        assert graph.output_ids == ["LLMInference_1"]

    def test_trace_resets_between_runs(self) -> None:
        tracer = Tracer()
        g1 = tracer.trace_values(Two(), "x")
        g2 = tracer.trace_values(Two(), "y")
        assert list(g1.nodes) == list(g2.nodes)
        assert g1.nodes["input:input_0"].module.value.payload == "x"


class TestComposites:
    def test_nested_composites_are_traced_through(self) -> None:
        class Inner(Module):
            def __init__(self) -> None:
                super().__init__()
                self.step = LLMInference("inner")

            def forward(self, x: Value) -> Value:
                return self.step(x)

        class Middle(Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = Inner()
                self.after = LLMInference("after")

            def forward(self, x: Value) -> Value:
                return self.after(self.inner(x))

        class Outer(Module):
            def __init__(self) -> None:
                super().__init__()
                self.middle = Middle()
                self.final = LLMInference("final")

            def forward(self, x: Value) -> Value:
                return self.final(self.middle(x))

        outer = Outer()
        graph = trace(outer, "x")
        paths = [n.module_path for n in graph.nodes.values() if n.kind == "llm"]
        assert paths == ["middle.inner.step", "middle.after", "final"]
        assert all(n.module_name == "LLMInference" for n in graph.nodes.values() if n.kind == "llm")
        order = graph.topological_order()
        assert order.index("LLMInference_1") < order.index("LLMInference_2") < order.index("LLMInference_3")

    def test_tracing_a_submodule_gives_paths_relative_to_it(self) -> None:
        class Inner(Module):
            def __init__(self) -> None:
                super().__init__()
                self.step = LLMInference("inner")

            def forward(self, x: Value) -> Value:
                return self.step(x)

        class Outer(Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = Inner()

            def forward(self, x: Value) -> Value:
                return self.inner(x)

        outer = Outer()
        graph = trace(outer.inner, "x")
        assert graph.nodes["LLMInference_1"].module_path == "step"
        assert outer.inner.get_submodule("step") is outer.inner.step

    def test_sequential_and_module_list(self) -> None:
        seq = Sequential(LLMInference("a"), LLMInference("b"), LLMInference("c"))
        graph = trace(seq, "x")
        assert [n.module_path for n in graph.nodes.values() if n.kind == "llm"] == ["0", "1", "2"]
        assert graph.nodes["LLMInference_3"].dependencies == ["LLMInference_2"]

        class Layers(Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = ModuleList([LLMInference("a"), LLMInference("b")])

            def forward(self, x: Value) -> list[Value]:
                return [layer(x) for layer in self.layers]

        graph = trace(Layers(), "x")
        assert graph.output_structure == ["LLMInference_1", "LLMInference_2"]
        assert [n.module_path for n in graph.nodes.values() if n.kind == "llm"] == ["layers.0", "layers.1"]

    def test_same_module_called_twice_gives_two_nodes(self) -> None:
        class Twice(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.llm(self.llm(x))

        graph = trace(Twice(), "x")
        assert graph.nodes["LLMInference_2"].dependencies == ["LLMInference_1"]
        assert graph.nodes["LLMInference_1"].module is graph.nodes["LLMInference_2"].module


class TestOutputs:
    def test_dict_output_structure(self) -> None:
        class Both(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")
                self.b = LLMInference("b")

            def forward(self, x: Value) -> dict[str, Any]:
                return {"first": self.a(x), "nested": {"second": self.b(x)}}

        graph = trace(Both(), "x")
        assert graph.output_structure == {"first": "LLMInference_1", "nested": {"second": "LLMInference_2"}}
        assert graph.output_ids == ["LLMInference_1", "LLMInference_2"]

    def test_literal_output_becomes_a_constant_node(self) -> None:
        class Lit(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> dict[str, Any]:
                return {"answer": self.a(x), "version": 2}

        graph = trace(Lit(), "x")
        version_id = graph.output_structure["version"]
        assert graph.nodes[version_id].module_name == "F.constant"

    def test_returning_the_input(self) -> None:
        class Identity(Module):
            is_leaf = False

            def forward(self, x: Value) -> Value:
                return x

        graph = trace(Identity(), "x")
        assert graph.output_ids == ["input:input_0"]

    async def test_literal_outputs_run(self, resources: ScriptedResources) -> None:
        class Lit(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> dict[str, Any]:
                return {"answer": self.a(x), "version": 2, "tags": ["t"]}

        assert await run(Lit(), "x", resources=resources) == {"answer": "a(x)", "version": 2, "tags": ["t"]}


class Templated(Module):
    def __init__(self) -> None:
        super().__init__()
        self.draft = LLMInference("draft")
        self.review = LLMInference("review")

    def forward(self, topic: Value) -> Value:
        draft = self.draft(f"Write about {topic}.")
        return self.review(f"Review {{strictly}}: {draft} (topic: {topic})")


class TestFStrings:
    def test_fstring_becomes_a_render_node(self) -> None:
        graph = trace(Templated(), "cats")
        renders = [n for n in graph.nodes.values() if n.module_name == "F.render"]
        assert len(renders) == 2
        first, second = renders
        assert first.dependencies == ["input:input_0"]
        assert (first.id, second.id) == ("F.render_1", "F.render_3")
        assert second.dependencies == ["LLMInference_2", "input:input_0"]
        draft_node = next(n for n in graph.nodes.values() if n.module_path == "draft")
        assert draft_node.dependencies == [first.id]

    def test_render_nodes_never_contain_the_value_repr(self) -> None:
        graph = trace(Templated(), "cats")
        blob = graph.to_json()
        assert "Value(" not in blob and "ValueKind" not in blob
        for node in graph.nodes.values():
            assert "Value(" not in repr(node.args) or node.kind == "input"

    async def test_fstrings_run_with_real_payloads(self, resources: ScriptedResources) -> None:
        out = await run(Templated(), "cats", resources=resources)
        assert resources.prompts("draft") == ["Write about cats."]
        assert resources.prompts("review") == ["Review {strictly}: draft(Write about cats.) (topic: cats)"]
        assert out == "review(Review {strictly}: draft(Write about cats.) (topic: cats))"

    async def test_literal_braces_survive(self, resources: ScriptedResources) -> None:
        class Braces(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.llm(f'JSON: {{"key": "{x}"}} {{x}} {{{{double}}}}')

        await run(Braces(), "v", resources=resources)
        assert resources.prompts() == ['JSON: {"key": "v"} {x} {{double}}']

    async def test_str_and_format_and_concatenation(self, resources: ScriptedResources) -> None:
        class Mixed(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")
                self.b = LLMInference("b")

            def forward(self, x: Value) -> Value:
                first = self.a(x)
                return self.b("Q: " + str(first) + " / {}".format(x) + " / %s" % x)  # noqa: UP031, UP032

        await run(Mixed(), "x", resources=resources)
        assert resources.prompts("b") == ["Q: a(x) / x / x"]

    async def test_fstring_as_output_and_kwarg(self, resources: ScriptedResources) -> None:
        class Out(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")
                self.echo = Echo()

            def forward(self, x: Value) -> dict[str, Any]:
                r = self.a(x)
                return {"text": f"<{r}>", "echo": self.echo(x, extra=f"[{r}]"), "nested": [f"{x}!"]}

        out = await run(Out(), "x", resources=resources)
        assert out == {"text": "<a(x)>", "echo": "x", "nested": ["x!"]}

    async def test_structured_payload_renders_as_json(self) -> None:
        class S(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")
                self.b = LLMInference("b")

            def forward(self, x: Value) -> Value:
                data = F.parse_structured(self.a(x))
                return self.b(f"data={data} name={data['name']}")

        res = ScriptedResources(lambda alias, request: '{"name": "ada"}' if alias == "a" else "ok")
        await run(S(), "x", resources=res)
        assert res.prompts("b") == ['data={"name": "ada"} name=ada']

    def test_format_spec_on_traced_value_is_a_clear_type_error(self) -> None:
        class Spec(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.a(f"{x:>10}")

        with pytest.raises(TypeError, match="format spec"):
            trace(Spec(), "x")

    async def test_repr_conversion_does_not_bake_the_value_repr(self, resources: ScriptedResources) -> None:
        class Repr(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.a(f"{x!r}")

        graph = trace(Repr(), "x")
        assert "Value(" not in graph.to_json()
        await run(Repr(), "x", resources=resources)
        assert "Value(" not in resources.prompts()[0]

    def test_bool_of_traced_value_is_a_type_error(self) -> None:
        class Branch(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.a(x) if self.a(x) else x

        with pytest.raises(TypeError, match="run time"):
            trace(Branch(), "x")

    def test_iterating_a_traced_value_is_a_type_error(self) -> None:
        class Loop(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> Any:
                return [item for item in self.a(x)]

        with pytest.raises(TypeError, match="iterate"):
            trace(Loop(), "x")

    def test_str_outside_a_trace_is_the_payload(self) -> None:
        v = Value(ValueKind.TEXT, "plain", "LLMInference_1")
        assert f"{v}" == "plain"

    def test_slicing_a_formatted_traced_value_is_a_clear_error(self) -> None:
        class Slice(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.a(f"start {x}"[:8])

        with pytest.raises(TypeError, match="trace time"):
            trace(Slice(), "x")


class TestAsync:
    def test_async_composite_forward_is_a_clear_error(self) -> None:
        class AsyncComposite(Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = LLMInference("a")

            async def forward(self, x: Value) -> Value:  # type: ignore[override]
                return self.a(x)

        class Outer(Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = AsyncComposite()

            def forward(self, x: Value) -> Value:
                return self.inner(x)

        with pytest.raises(TypeError, match="async"):
            trace(AsyncComposite(), "x")
        with pytest.raises(TypeError, match="async"):
            trace(Outer(), "x")

    async def test_async_leaf_forward_runs(self, resources: ScriptedResources) -> None:
        class AsyncLeaf(Module):
            async def forward(self, x: str) -> str:
                return x[::-1]

        class Outer(Module):
            def __init__(self) -> None:
                super().__init__()
                self.flip = AsyncLeaf()
                self.a = LLMInference("a")

            def forward(self, x: Value) -> Value:
                return self.a(self.flip(x))

        assert await run(Outer(), "abc", resources=resources) == "a(cba)"
