"""Module: registration, the tree API, state dicts, modes, containers, calling patterns and LLMInference."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel

import app.pipeline.functional as F
from app.pipeline import (
    BatchResult,
    ExecutionSettings,
    InferenceModule,
    LLMInference,
    Module,
    ModuleDict,
    ModuleList,
    Parameter,
    ParameterDict,
    ParameterList,
    Sequential,
    Value,
    ValueKind,
    run,
    trace,
)
from app.pipeline.backward import BackwardContext, BackwardResult
from tests.support.fakes import ScriptedResources


class Upper(Module):
    def forward(self, x: str) -> str:
        return x.upper()


class Suffix(Module):
    def __init__(self, suffix: str) -> None:
        super().__init__()
        self.suffix = suffix

    def forward(self, x: str) -> str:
        return x + self.suffix


class WithPrompt(Module):
    def __init__(self, text: str = "p") -> None:
        super().__init__()
        self.prompt = Parameter(text, description="a prompt")

    def forward(self, x: str) -> str:
        return x


class Tree(Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = WithPrompt("A")
        self.b = WithPrompt("B")
        self.b.inner = WithPrompt("BI")
        self.own = Parameter("own", description="own prompt")

    def forward(self, x: str) -> str:
        return x


class TestRegistration:
    def test_inference_module_alias(self) -> None:
        assert InferenceModule is Module

    def test_modules_and_parameters_register(self) -> None:
        t = Tree()
        assert dict(t.named_children()) == {"a": t.a, "b": t.b}
        assert list(t.children()) == [t.a, t.b]
        assert t._parameters == {"own": t.own}
        assert t.a._name == "a" and t.a._parent is t
        assert t.b.inner._parent is t.b

    def test_plain_attributes_are_not_registered(self) -> None:
        m = Suffix("!")
        assert m.suffix == "!"
        assert list(m.children()) == [] and list(m.parameters()) == []

    def test_reassignment_replaces_registration(self) -> None:
        t = Tree()
        replacement = WithPrompt("new")
        t.a = replacement
        assert dict(t.named_children())["a"] is replacement
        t.a = Parameter("now a param", description="d")  # type: ignore[assignment]
        assert "a" not in dict(t.named_children())
        assert "a" in dict(t.named_parameters())
        t.a = "plain"  # type: ignore[assignment]
        assert "a" not in dict(t.named_parameters()) and "a" not in dict(t.named_children())
        assert t.a == "plain"

    def test_reassignment_keeps_position(self) -> None:
        t = Tree()
        t.a = WithPrompt("A2")
        assert [name for name, _ in t.named_children()] == ["a", "b"]

    def test_delattr_unregisters(self) -> None:
        t = Tree()
        del t.b
        del t.own
        assert [n for n, _ in t.named_children()] == ["a"]
        assert [n for n, _ in t.named_parameters()] == ["a.prompt"]

    def test_forgetting_super_init_is_a_clear_error(self) -> None:
        class Bad(Module):
            def __init__(self) -> None:
                self.child = Upper()

        with pytest.raises(RuntimeError, match="super"):
            Bad()

    def test_forward_not_defined(self) -> None:
        with pytest.raises(NotImplementedError):
            Module().forward("x")

    def test_repr_shows_children(self) -> None:
        text = repr(Tree())
        assert "(a): WithPrompt" in text and "(inner): WithPrompt" in text


class TestTree:
    def test_named_modules_default_and_prefix(self) -> None:
        t = Tree()
        assert [n for n, _ in t.named_modules()] == ["", "a", "b", "b.inner"]
        assert [n for n, _ in t.named_modules("root")] == ["root", "root.a", "root.b", "root.b.inner"]
        assert list(t.modules()) == [t, t.a, t.b, t.b.inner]

    def test_named_parameters_dotted(self) -> None:
        t = Tree()
        names = [n for n, _ in t.named_parameters()]
        assert names == ["own", "a.prompt", "b.prompt", "b.inner.prompt"]
        assert [n for n, _ in t.named_parameters("m")] == ["m.own", "m.a.prompt", "m.b.prompt", "m.b.inner.prompt"]
        assert list(t.parameters()) == [p for _, p in t.named_parameters()]
        assert [n for n, _ in t.named_parameters(recurse=False)] == ["own"]

    def test_shared_parameter_is_deduplicated(self) -> None:
        shared = Parameter("shared", description="shared prompt")

        class Twin(Module):
            def __init__(self) -> None:
                super().__init__()
                self.x = WithPrompt()
                self.y = WithPrompt()
                self.x.prompt = shared
                self.y.prompt = shared

        t = Twin()
        named = list(t.named_parameters())
        assert [p for _, p in named].count(shared) == 1
        assert len(list(t.parameters())) == 1
        assert named[0][0] == "x.prompt"

    def test_shared_module_is_deduplicated(self) -> None:
        child = WithPrompt()

        class Twice(Module):
            def __init__(self) -> None:
                super().__init__()
                self.first = child
                self.second = child

        t = Twice()
        assert [m for m in t.modules()].count(child) == 1
        assert len(list(t.parameters())) == 1

    def test_get_submodule(self) -> None:
        t = Tree()
        assert t.get_submodule("b.inner") is t.b.inner
        assert t.get_submodule("") is t
        with pytest.raises(AttributeError):
            t.get_submodule("nope")


class TestStateDict:
    def test_state_dict_round_trip(self) -> None:
        t = Tree()
        state = t.state_dict()
        assert state == {"own": "own", "a.prompt": "A", "b.prompt": "B", "b.inner.prompt": "BI"}
        other = Tree()
        other.load_state_dict({**state, "b.inner.prompt": "tuned"})
        assert other.b.inner.prompt.value == "tuned"
        assert other.state_dict()["b.inner.prompt"] == "tuned"

    def test_partial_load(self) -> None:
        t = Tree()
        t.load_state_dict({"a.prompt": "A2"})
        assert t.a.prompt.value == "A2" and t.b.prompt.value == "B"

    def test_unknown_key_is_key_error_and_changes_nothing(self) -> None:
        t = Tree()
        with pytest.raises(KeyError, match="nope"):
            t.load_state_dict({"a.prompt": "changed", "nope": "x"})
        assert t.a.prompt.value == "A"

    def test_load_bumps_owner_version_when_changed(self) -> None:
        t = Tree()
        t.load_state_dict({"b.inner.prompt": "new"})
        assert t.b.inner._module_state_version == 1
        t.load_state_dict({"b.inner.prompt": "new"})  # unchanged: no bump
        assert t.b.inner._module_state_version == 1

    def test_state_dict_includes_frozen_and_containers(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("fast", system_prompt="sys")
                self.plist = ParameterList([Parameter("p0", description="d")])
                self.pdict = ParameterDict({"k": Parameter("pk", requires_grad=False)})

        assert M().state_dict() == {"llm.system_prompt": "sys", "plist.0": "p0", "pdict.k": "pk"}


class TestModes:
    def test_default_is_eval(self) -> None:
        assert Tree().training is False

    def test_train_and_eval_are_recursive_and_chain(self) -> None:
        t = Tree()
        assert t.train() is t
        assert all(m.training for m in t.modules())
        assert t.eval() is t
        assert not any(m.training for m in t.modules())
        t.train(True)
        t.b.train(False)
        assert t.training and t.a.training and not t.b.training and not t.b.inner.training

    def test_requires_grad_toggle(self) -> None:
        t = Tree()
        assert t.requires_grad_(False) is t
        assert not any(p.requires_grad for p in t.parameters())
        t.requires_grad_(True)
        assert all(p.requires_grad for p in t.parameters())
        t.b.requires_grad_(False)
        assert t.a.prompt.requires_grad and not t.b.inner.prompt.requires_grad

    def test_requires_grad_on_undescribed_parameter_fails_atomically(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.first = Parameter("a", description="d", requires_grad=False)
                self.second = Parameter("b", requires_grad=False)

        m = M()
        with pytest.raises(ValueError):
            m.requires_grad_(True)
        assert m.first.requires_grad is False

    def test_frozen_parameter_ignores_feedback_after_requires_grad_false(self) -> None:
        t = Tree()
        t.requires_grad_(False)
        t.own.accumulate_feedback("x")
        assert t.own.get_accumulated_feedback() == []


class TestContainers:
    def test_sequential_forward_and_indexing(self) -> None:
        seq = Sequential(Suffix("a"), Upper(), Suffix("b"))
        assert seq("x") == "XAb"
        assert len(seq) == 3
        assert isinstance(seq[1], Upper)
        assert isinstance(seq[-1], Suffix)
        assert [type(m).__name__ for m in seq] == ["Suffix", "Upper", "Suffix"]
        assert [n for n, _ in seq.named_children()] == ["0", "1", "2"]

    def test_sequential_from_dict(self) -> None:
        seq = Sequential({"first": Suffix("1"), "second": Suffix("2")})
        assert seq("x") == "x12"
        assert [n for n, _ in seq.named_children()] == ["first", "second"]
        assert isinstance(seq.first, Suffix)

    def test_sequential_rejects_non_modules(self) -> None:
        with pytest.raises(TypeError):
            Sequential(Upper(), "nope")  # type: ignore[arg-type]

    def test_sequential_parameters(self) -> None:
        seq = Sequential(WithPrompt("a"), WithPrompt("b"))
        assert [n for n, _ in seq.named_parameters()] == ["0.prompt", "1.prompt"]

    def test_module_list(self) -> None:
        ml = ModuleList([Suffix("a"), Suffix("b")])
        ml.append(Suffix("c"))
        ml.extend([Suffix("d")])
        assert len(ml) == 4
        assert [m.suffix for m in ml] == ["a", "b", "c", "d"]
        assert ml[-1].suffix == "d"
        ml[1] = Suffix("B")
        assert [m.suffix for m in ml] == ["a", "B", "c", "d"]
        assert [n for n, _ in ml.named_children()] == ["0", "1", "2", "3"]
        with pytest.raises(TypeError):
            ml("x")

    def test_module_list_rejects_non_modules(self) -> None:
        with pytest.raises(TypeError):
            ModuleList(["nope"])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            ModuleList().append(Parameter("p", description="d"))  # type: ignore[arg-type]

    def test_module_list_in_parent(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = ModuleList([WithPrompt("0"), WithPrompt("1")])

            def forward(self, x: str) -> str:
                for layer in self.layers:
                    x = layer(x)
                return x

        m = M()
        assert [n for n, _ in m.named_parameters()] == ["layers.0.prompt", "layers.1.prompt"]
        assert m.layers[1].prompt.ref == "param:layers.1.prompt"

    def test_module_dict(self) -> None:
        md = ModuleDict({"up": Upper(), "sfx": Suffix("!")})
        md["more"] = Suffix("?")
        assert len(md) == 3 and "up" in md and "zzz" not in md
        assert list(md) == ["up", "sfx", "more"]
        assert md.keys() == ["up", "sfx", "more"]
        assert isinstance(md["up"], Upper)
        assert [type(m).__name__ for m in md.values()] == ["Upper", "Suffix", "Suffix"]
        assert [k for k, _ in md.items()] == ["up", "sfx", "more"]
        with pytest.raises(KeyError):
            md["zzz"]
        with pytest.raises(TypeError):
            md("x")

    def test_parameter_list_and_dict(self) -> None:
        pl = ParameterList([Parameter("a", description="d")])
        pl.append(Parameter("b", description="d"))
        assert len(pl) == 2 and [p.value for p in pl] == ["a", "b"] and pl[-1].value == "b"
        pd = ParameterDict({"x": Parameter("1", description="d")})
        pd["y"] = Parameter("2", requires_grad=False)
        assert len(pd) == 2 and "y" in pd and list(pd) == ["x", "y"]
        assert pd.keys() == ["x", "y"] and [p.value for p in pd.values()] == ["1", "2"]
        assert [n for n, _ in pd.named_parameters()] == ["x", "y"]
        with pytest.raises(TypeError):
            pl("x")
        with pytest.raises(TypeError):
            pd("x")

    def test_parameter_list_rejects_non_parameters(self) -> None:
        with pytest.raises(TypeError):
            ParameterList(["raw"])  # type: ignore[list-item]

    def test_parameter_containers_do_not_make_a_module_composite(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.prompts = ParameterList([Parameter("p", description="d")])

            def forward(self, x: str) -> str:
                return x

        graph = trace(M(), "x")
        assert [n.module_name for n in graph.nodes.values() if n.kind != "input"] == ["M"]


class TestCalling:
    def test_without_resources_calls_forward(self) -> None:
        assert Upper()("abc") == "ABC"
        assert Sequential(Upper(), Suffix("!"))("a") == "A!"

    def test_bind_returns_self_and_rejects_unknown_settings(self) -> None:
        m = Upper()
        assert m.bind(ScriptedResources()) is m
        with pytest.raises(TypeError, match="unknown"):
            Upper().bind(ScriptedResources(), not_a_setting=1)

    async def test_bound_call_returns_awaitable(self) -> None:
        m = Upper().bind(ScriptedResources())
        pending = m("abc")
        assert asyncio.iscoroutine(pending) or hasattr(pending, "__await__")
        assert await pending == "ABC"

    async def test_bound_llm_pipeline(self, resources: ScriptedResources) -> None:
        class Chain(Module):
            def __init__(self) -> None:
                super().__init__()
                self.first = LLMInference("fast")
                self.second = LLMInference("smart")

            def forward(self, x: Value) -> Value:
                return self.second(self.first(x))

        chain = Chain().bind(resources)
        assert await chain("q") == "smart(fast(q))"
        assert resources.prompts() == ["q", "fast(q)"]

    async def test_execution_settings_resources(self, resources: ScriptedResources) -> None:
        llm = LLMInference("fast")
        with ExecutionSettings(resources=resources):
            assert await llm("hi") == "fast(hi)"

    async def test_batch_call_runs_every_item(self, resources: ScriptedResources) -> None:
        llm = LLMInference("fast").bind(resources)
        assert await llm(["a", "b", "c"]) == ["fast(a)", "fast(b)", "fast(c)"]

    async def test_streaming_batch(self, resources: ScriptedResources) -> None:
        llm = LLMInference("fast").bind(resources)
        results: list[BatchResult] = []
        async for r in llm(["a", "b"], streaming=True, preserve_order=True):
            results.append(r)
        assert [(r.index, r.input, r.output, r.ok) for r in results] == [
            (0, "a", "fast(a)", True),
            (1, "b", "fast(b)", True),
        ]

    async def test_config_precedence_call_over_bind_over_settings(self) -> None:
        from_settings, from_bind, from_call = (ScriptedResources(lambda a, r, tag=tag: tag)
                                               for tag in ("settings", "bind", "call"))
        llm = LLMInference("fast")
        with ExecutionSettings(resources=from_settings):
            assert await llm("x") == "settings"
            llm.bind(from_bind)
            assert await llm("x") == "bind"
            assert await llm("x", resources=from_call) == "call"

    async def test_batch_failure_raises_but_stream_isolates_it(self) -> None:
        res = ScriptedResources(lambda alias, request: ValueError("bad item") if request.prompt == "b" else "ok")
        llm = LLMInference("fast").bind(res)
        with pytest.raises(ValueError, match="bad item"):
            await llm(["a", "b", "c"])
        results = [r async for r in llm(["a", "b", "c"], streaming=True, preserve_order=True)]
        assert [r.ok for r in results] == [True, False, True]
        assert isinstance(results[1].error, ValueError) and results[1].output is None

    def test_run_sync(self, resources: ScriptedResources) -> None:
        llm = LLMInference("fast").bind(resources)
        assert llm.run_sync("x") == "fast(x)"

    async def test_run_sync_inside_a_loop_is_an_error(self) -> None:
        with pytest.raises(RuntimeError, match="event loop"):
            Upper().bind(ScriptedResources()).run_sync("x")

    async def test_default_backward_passes_feedback_to_inputs(self) -> None:
        ctx = BackwardContext(node_id="Upper_1", inputs={"arg_0": "x", "style": "y"})
        result = await Upper().backward("needs work", ctx)
        assert isinstance(result, BackwardResult)
        assert result.input_feedback == {name: "needs work" for name in ctx.input_names()}
        assert set(result.input_feedback) >= {"style"}


class TestLLMInference:
    def test_defaults(self) -> None:
        llm = LLMInference("fast")
        assert llm.alias == "fast"
        assert llm.temperature == 1.0 and llm.max_tokens is None and llm.response_format is None
        assert isinstance(llm.system_prompt, Parameter)
        assert llm.system_prompt.value == "" and llm.system_prompt.requires_grad is False

    def test_string_prompt_becomes_frozen_parameter(self) -> None:
        llm = LLMInference("fast", system_prompt="be terse", temperature=0.2, max_tokens=64)
        assert isinstance(llm.system_prompt, Parameter)
        assert llm.system_prompt.value == "be terse"
        assert llm.system_prompt.requires_grad is False
        assert dict(llm.named_parameters()) == {"system_prompt": llm.system_prompt}
        assert llm.system_prompt.ref == "param:system_prompt"
        assert (llm.temperature, llm.max_tokens) == (0.2, 64)
        llm.system_prompt.accumulate_feedback("ignored")
        assert llm.system_prompt.get_accumulated_feedback() == []

    def test_parameter_prompt_is_used_as_given(self) -> None:
        p = Parameter("be terse", description="the system prompt")
        llm = LLMInference("fast", system_prompt=p)
        assert llm.system_prompt is p
        assert p.requires_grad is True
        assert p._parent is llm and p._name == "system_prompt"

    def test_nested_prompt_name(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.summarizer = LLMInference("fast", system_prompt=Parameter("s", description="d"))

        assert [n for n, _ in M().named_parameters()] == ["summarizer.system_prompt"]

    def test_forward_is_not_called_directly(self) -> None:
        with pytest.raises(RuntimeError, match="resources"):
            LLMInference("fast")("hi")

    def test_alias_is_required(self) -> None:
        with pytest.raises(ValueError):
            LLMInference("")

    def test_invalid_max_tokens(self) -> None:
        with pytest.raises(ValueError):
            LLMInference("fast", max_tokens=0)

    def test_node_config_names_no_model(self) -> None:
        class Out(BaseModel):
            answer: str

        llm = LLMInference("fast", system_prompt="s", temperature=0.5, max_tokens=10, response_format=Out)
        config = llm.node_config()
        assert config["alias"] == "fast" and config["system_prompt"] == "s"
        assert config["temperature"] == 0.5 and config["max_tokens"] == 10
        assert config["response_format"].endswith("Out")
        assert llm.output_kind() is ValueKind.STRUCTURED
        assert LLMInference("fast").output_kind() is ValueKind.RESPONSE

    async def test_request_carries_module_settings(self, resources: ScriptedResources) -> None:
        llm = LLMInference("fast", system_prompt="be terse", temperature=0.3, max_tokens=12)
        assert await run(llm, "hello", resources=resources) == "fast(hello)"
        alias, request = resources.requests[0]
        assert alias == "fast"
        assert request.prompt == "hello"
        assert request.system_prompt == "be terse"
        assert request.temperature == 0.3 and request.max_tokens == 12

    async def test_learnable_prompt_value_is_sent(self, resources: ScriptedResources) -> None:
        p = Parameter("v1", description="the system prompt")
        llm = LLMInference("fast", system_prompt=p)
        await run(llm, "q", resources=resources)
        p.apply_update("v2")
        await run(llm, "q", resources=resources)
        assert [r.system_prompt for _, r in resources.requests] == ["v1", "v2"]

    async def test_response_format_parses_structured(self) -> None:
        class Out(BaseModel):
            answer: str
            score: int

        res = ScriptedResources(lambda alias, request: '{"answer": "yes", "score": 3}')
        llm = LLMInference("fast", response_format=Out)
        assert await run(llm, "q", resources=res) == {"answer": "yes", "score": 3}

    async def test_output_meta_has_alias_and_tokens(self, resources: ScriptedResources) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("fast")

            def forward(self, x: Value) -> Value:
                return F.extract_meta(self.llm(x))

        meta: Any = await run(M(), "q", resources=resources)
        assert meta["alias"] == "fast"
        assert meta["input_tokens"] == 3 and meta["output_tokens"] == 5

    async def test_llm_backward_writes_parameter_feedback(self) -> None:
        p = Parameter("be terse", description="the system prompt")
        llm = LLMInference("fast", system_prompt=p)
        ctx = BackwardContext(node_id="LLMInference_1", inputs={"prompt": "the question"}, output="the answer")
        result = await llm.backward(SimpleNamespace(content="too short", score=0.25), ctx)
        assert "prompt" in result.input_feedback
        assert len(result.parameter_feedback) == 1
        text = next(iter(result.parameter_feedback.values()))
        assert "be terse" in text and "the system prompt" in text
        assert "the question" in text and "the answer" in text and "too short" in text and "0.25" in text

    async def test_llm_backward_frozen_prompt_has_no_parameter_feedback(self) -> None:
        llm = LLMInference("fast", system_prompt="frozen")
        ctx = BackwardContext(node_id="LLMInference_1", inputs={"prompt": "q"}, output="a")
        result = await llm.backward(SimpleNamespace(content="meh", score=0.5), ctx)
        assert result.parameter_feedback == {}

    def test_string_prompt_can_be_made_learnable(self) -> None:
        llm = LLMInference("fast", system_prompt="be terse")
        assert llm.system_prompt.description
        llm.requires_grad_(True)
        assert llm.system_prompt.requires_grad is True
