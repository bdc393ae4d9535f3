"""InferenceGraph: structure queries, cycles, the Merkle hash, JSON round trips and DOT output."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from pydantic import BaseModel

import app.pipeline.functional as F
from app.pipeline import (
    ExecutionState,
    GraphNode,
    InferenceGraph,
    InputNode,
    LLMInference,
    Module,
    OpNode,
    Parameter,
    Scheduler,
    Value,
    ValueKind,
    ValueRef,
    trace,
)
from tests.support.fakes import ScriptedResources


def node(node_id: str, *deps: str, priority: int = 0) -> GraphNode:
    return GraphNode(node_id, OpNode("F.concat"), tuple(ValueRef(d) for d in deps), {}, list(deps), priority)


def graph_of(*nodes: GraphNode, outputs: list[str] | None = None) -> InferenceGraph:
    by_id = {n.id: n for n in nodes}
    return InferenceGraph(by_id, [n.id for n in nodes if not n.dependencies], outputs or [nodes[-1].id])


class Schema(BaseModel):
    a: int


class Pipeline(Module):
    def __init__(self, temperature: float = 1.0, prompt: str = "be brief") -> None:
        super().__init__()
        self.draft = LLMInference("fast", system_prompt=Parameter(prompt, description="drafting style"),
                                  temperature=temperature)
        self.review = LLMInference("smart", system_prompt="check facts")

    def forward(self, topic: Value) -> dict[str, Any]:
        draft = self.draft(f"Write about {topic}.")
        return {"draft": draft, "final": self.review(F.concat("Review: ", draft))}


class TestGraphNode:
    def test_fields_and_defaults(self) -> None:
        n = GraphNode(id="n", module=OpNode("F.upper"))
        assert (n.args, n.kwargs, n.dependencies, n.priority, n.module_name, n.module_path) == ((), {}, [], 0, "", "")
        assert n.kind == "op"

    def test_kinds(self) -> None:
        assert GraphNode("i", InputNode(Value(ValueKind.TEXT, "x"))).kind == "input"
        llm = GraphNode("l", LLMInference("fast"))
        assert llm.kind == "llm" and llm.alias == "fast"

        class Leaf(Module):
            def forward(self, x: Any) -> Any:
                return x

        assert GraphNode("m", Leaf()).kind == "module"
        assert GraphNode("m", Leaf()).alias is None


class TestStructure:
    def test_topological_order_linear_and_diamond(self) -> None:
        g = graph_of(node("in"), node("a", "in"), node("b", "in"), node("join", "a", "b"))
        order = g.topological_order()
        assert order[0] == "in" and order[-1] == "join"
        assert set(order) == {"in", "a", "b", "join"}

    def test_topological_order_respects_every_edge(self) -> None:
        g = graph_of(node("x"), node("y"), node("c", "b", "x"), node("b", "a"), node("a", "y"), outputs=["c"])
        order = g.topological_order()
        for n in g.nodes.values():
            for dep in n.dependencies:
                assert order.index(dep) < order.index(n.id)

    def test_cycle_is_a_value_error_naming_it(self) -> None:
        g = graph_of(node("in"), node("a", "in", "c"), node("b", "a"), node("c", "b"), node("out", "c"))
        with pytest.raises(ValueError, match="cycle") as info:
            g.topological_order()
        message = str(info.value)
        cycle = re.search(r"(\w+ -> )+\w+", message)
        assert cycle is not None
        names = cycle.group(0).split(" -> ")
        assert names[0] == names[-1] and set(names) == {"a", "b", "c"}
        assert "in" not in names and "out" not in names

    def test_self_loop(self) -> None:
        g = InferenceGraph({"a": node("a", "a")}, [], ["a"])
        with pytest.raises(ValueError, match="a -> a"):
            g.topological_order()

    def test_unknown_dependency_is_a_value_error(self) -> None:
        g = InferenceGraph({"a": node("a", "ghost")}, [], ["a"])
        with pytest.raises(ValueError, match="ghost"):
            g.topological_order()

    def test_ancestors_and_descendants(self) -> None:
        g = graph_of(node("in"), node("a", "in"), node("b", "in"), node("c", "a"), node("d", "c", "b"))
        assert g.ancestors("d") == {"in", "a", "b", "c"}
        assert g.ancestors("a") == {"in"}
        assert g.ancestors("in") == set()
        assert g.descendants("in") == {"a", "b", "c", "d"}
        assert g.descendants("a") == {"c", "d"}
        assert g.descendants("d") == set()

    def test_traced_graph_queries(self) -> None:
        g = trace(Pipeline(), "cats")
        assert g.ancestors("LLMInference_4") == {"input:input_0", "F.render_1", "LLMInference_2", "F.concat_3"}
        assert g.descendants("LLMInference_2") == {"F.concat_3", "LLMInference_4"}
        assert g.depth()["LLMInference_4"] == 4


class TestHash:
    def test_hash_is_stable_across_traces_and_instances(self) -> None:
        h = trace(Pipeline(), "cats").compute_hash()
        assert re.fullmatch(r"[0-9a-f]{64}", h)
        assert trace(Pipeline(), "cats").compute_hash() == h
        assert trace(Pipeline(), "cats").compute_hash() == trace(Pipeline(), "cats").compute_hash()

    def test_hash_ignores_input_values(self) -> None:
        assert trace(Pipeline(), "cats").compute_hash() == trace(Pipeline(), "dogs").compute_hash()
        assert trace(Pipeline(), "x").compute_hash() == trace(Pipeline(), Value(ValueKind.TEXT, "y")).compute_hash()

    def test_hash_changes_with_config(self) -> None:
        base = trace(Pipeline(), "x").compute_hash()
        assert trace(Pipeline(temperature=0.5), "x").compute_hash() != base
        assert trace(Pipeline(prompt="be thorough"), "x").compute_hash() != base
        changed = Pipeline()
        changed.review.alias = "other"
        assert trace(changed, "x").compute_hash() != base

    def test_hash_changes_with_response_format(self) -> None:
        class Out(BaseModel):
            a: int

        m = Pipeline()
        base = trace(m, "x").compute_hash()
        m.review.response_format = Out
        assert trace(m, "x").compute_hash() != base

    def test_hash_changes_with_parameter_update(self) -> None:
        m = Pipeline()
        base = trace(m, "x").compute_hash()
        m.draft.system_prompt.apply_update("be thorough")
        assert trace(m, "x").compute_hash() != base

    def test_hash_changes_with_priority(self) -> None:
        g1 = trace(Pipeline(), "x")
        g2 = trace(Pipeline(), "x")
        g2.nodes["LLMInference_4"].priority = 3
        assert g1.compute_hash() != g2.compute_hash()

    def test_hash_changes_with_structure(self) -> None:
        class Longer(Pipeline):
            def forward(self, topic: Value) -> dict[str, Any]:
                out = super().forward(topic)
                out["final"] = self.review(out["final"])
                return out

        class Rewired(Pipeline):
            def forward(self, topic: Value) -> dict[str, Any]:
                draft = self.draft(f"Write about {topic}.")
                return {"draft": draft, "final": self.review(F.concat("Review: ", topic))}

        base = trace(Pipeline(), "x").compute_hash()
        assert trace(Longer(), "x").compute_hash() != base
        assert trace(Rewired(), "x").compute_hash() != base

    def test_hash_changes_with_templates_and_literal_arguments(self) -> None:
        class OtherTemplate(Pipeline):
            def forward(self, topic: Value) -> dict[str, Any]:
                draft = self.draft(f"Write a poem about {topic}.")
                return {"draft": draft, "final": self.review(F.concat("Review: ", draft))}

        base = trace(Pipeline(), "x").compute_hash()
        assert trace(OtherTemplate(), "x").compute_hash() != base

    def test_hash_survives_json_round_trip(self) -> None:
        g = trace(Pipeline(), "x")
        assert InferenceGraph.from_json(g.to_json()).compute_hash() == g.compute_hash()
        assert InferenceGraph.from_json(g.to_json(), root=Pipeline()).compute_hash() == g.compute_hash()


class TestJSON:
    def test_round_trip_without_root(self) -> None:
        g = trace(Pipeline(), "cats")
        text = g.to_json()
        data = json.loads(text)
        assert data["hash"] == g.compute_hash()
        back = InferenceGraph.from_json(text)
        assert list(back.nodes) == g.topological_order()
        assert back.input_ids == g.input_ids and back.output_ids == g.output_ids
        assert back.output_structure == g.output_structure
        for node_id, original in g.nodes.items():
            restored = back.nodes[node_id]
            assert restored.dependencies == original.dependencies
            assert restored.kind == original.kind
            assert restored.module_name == original.module_name
            assert restored.module_path == original.module_path
            assert restored.priority == original.priority
            if original.kind != "input":
                assert restored.args == original.args
                assert restored.kwargs == original.kwargs
        assert back.nodes["input:input_0"].module.value.payload == "cats"
        assert back.nodes["LLMInference_2"].alias == "fast"
        assert back.parameters == {"draft.system_prompt": "be brief", "review.system_prompt": "check facts"}

    def test_unbound_module_nodes_are_inspectable(self) -> None:
        back = InferenceGraph.from_json(trace(Pipeline(temperature=0.3), "x").to_json())
        llm = back.nodes["LLMInference_2"]
        assert llm.config()["temperature"] == 0.3
        assert llm.config()["system_prompt"] == "be brief"

    def test_round_trip_with_root_binds_modules(self) -> None:
        root = Pipeline()
        back = InferenceGraph.from_json(trace(Pipeline(), "x").to_json(), root=root)
        assert back.nodes["LLMInference_2"].module is root.draft
        assert back.nodes["LLMInference_4"].module is root.review
        assert back.parameters == dict(root.named_parameters())

    async def test_loaded_graph_runs_elsewhere(self) -> None:
        text = trace(Pipeline(), "cats").to_json()
        graph = InferenceGraph.from_json(text, root=Pipeline())
        res = ScriptedResources()
        outputs = await Scheduler(resource_manager=res).execute(ExecutionState(graph))
        assert outputs["draft"].payload == "fast(Write about cats.)"
        assert outputs["final"].payload == "smart(Review: fast(Write about cats.))"

    def test_to_dict_is_plain_json(self) -> None:
        data = trace(Pipeline(), "x").to_dict()
        assert json.loads(json.dumps(data)) == data
        assert data["version"] >= 1
        kinds = {n["id"]: n["kind"] for n in data["nodes"]}
        assert kinds == {"input:input_0": "input", "F.render_1": "op", "LLMInference_2": "llm",
                         "F.concat_3": "op", "LLMInference_4": "llm"}

    def test_rich_arguments_round_trip(self) -> None:
        args = (
            ValueRef("in"),
            ("tuple", 1),
            {"$weird": 1, 2: "int key"},
            b"\x00bytes",
            Value(ValueKind.INT, 3, None, {"m": 1}),
            ValueKind.TEXT,
            Schema,
            None,
            1.5,
        )
        g = InferenceGraph(
            {"in": GraphNode("in", InputNode(Value(ValueKind.TEXT, "x"))),
             "op": GraphNode("op", OpNode("F.concat"), args, {"k": [ValueRef("in")]}, ["in"])},
            ["in"], ["op"],
        )
        back = InferenceGraph.from_json(g.to_json())
        assert back.nodes["op"].args == args
        assert back.nodes["op"].kwargs == {"k": [ValueRef("in")]}

    def test_unserialisable_argument_is_a_clear_error(self) -> None:
        g = InferenceGraph({"op": GraphNode("op", OpNode("F.concat"), (object(),))}, [], ["op"])
        with pytest.raises(ValueError, match="serialise"):
            g.to_json()

    def test_unknown_version_is_rejected(self) -> None:
        data = trace(Pipeline(), "x").to_dict()
        data["version"] = 999
        with pytest.raises(ValueError, match="version"):
            InferenceGraph.from_dict(data)


class TestDot:
    def test_to_dot(self) -> None:
        g = trace(Pipeline(), "x")
        dot = g.to_dot()
        assert dot.startswith("digraph") and dot.rstrip().endswith("}")
        for node_id in g.nodes:
            assert f'"{node_id}"' in dot
        assert '"LLMInference_2" -> "F.concat_3";' in dot
        assert '"input:input_0" -> "F.render_1";' in dot
        assert "alias=fast" in dot
        assert dot.count("->") == sum(len(n.dependencies) for n in g.nodes.values())

    def test_to_dot_escapes_quotes(self) -> None:
        n = GraphNode('say "hi"', OpNode("F.upper"), module_name='F "upper"')
        dot = InferenceGraph({n.id: n}, [], [n.id]).to_dot()
        assert '"say \\"hi\\""' in dot and 'F \\"upper\\"' in dot

    def test_loading_with_a_mismatched_root_is_a_clear_error(self) -> None:
        class Other(Module):
            def __init__(self) -> None:
                super().__init__()
                self.draft = LLMInference("fast")

            def forward(self, x: Value) -> Value:
                return self.draft(x)

        text = trace(Pipeline(), "x").to_json()
        with pytest.raises(ValueError, match="review"):
            InferenceGraph.from_json(text, root=Other())

    def test_module_created_inside_forward_is_not_bound_to_the_root(self) -> None:
        class AdHoc(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("fast")

            def forward(self, x: Value) -> Value:
                return LLMInference("other")(self.llm(x))

        text = trace(AdHoc(), "x").to_json()
        with pytest.raises(ValueError, match="inside forward"):
            InferenceGraph.from_json(text, root=AdHoc())


def test_stored_type_tags_never_import_a_module() -> None:
    import sys

    from app.pipeline.graph import decode_json, encode_json

    assert decode_json(encode_json(Value)) is Value  # a loaded class round-trips
    sys.modules.pop("this", None)
    with pytest.raises(ValueError, match="not loaded"):
        decode_json({"$type": "this:s"})
    assert "this" not in sys.modules
