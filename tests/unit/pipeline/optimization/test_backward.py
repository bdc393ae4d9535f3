"""Backward through recorded graphs: order, fan-out, parameter accumulation, custom backward, batches."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import app.pipeline.functional as F
from app.pipeline import LLMInference, Module, Parameter, Value, run
from app.pipeline.optimization import (
    BackwardContext,
    BackwardResult,
    Feedback,
    FeedbackType,
    SFAOptimizer,
    VerifierLoss,
)
from tests.support.pipeline_modules import FanOut, Join, prompt

from .conftest import AliasLM


class Chain(Module):
    def __init__(self) -> None:
        super().__init__()
        self.draft = LLMInference("fast", system_prompt=prompt("Draft it.", "drafting instructions"))
        self.polish = LLMInference("fast", system_prompt=prompt("Polish it.", "polishing instructions"))

    def forward(self, x: Any) -> Any:
        return self.polish(self.draft(x))


def fail(message: str) -> VerifierLoss:
    return VerifierLoss(lambda out: (False, message))


class TestOrderAndAccumulation:
    async def test_chain_runs_backward_in_reverse_order(self) -> None:
        module = Chain().bind(AliasLM()).train()
        out = await module("topic")
        feedback = await fail("too vague")(out)
        report = await feedback.backward()
        (one,) = report.passes
        assert one.order == ["LLMInference_2", "LLMInference_1"]
        assert one.node_feedback["input:input_0"].content == "too vague"
        draft, polish = module.draft.system_prompt, module.polish.system_prompt
        assert len(draft.get_accumulated_feedback()) == 1 and len(polish.get_accumulated_feedback()) == 1
        text = draft.get_accumulated_feedback()[0]
        assert "Draft it." in text and "drafting instructions" in text and "topic" in text and "too vague" in text
        assert "fast(topic)" in text  # the draft's own output is quoted
        assert set(report.parameter_feedback) == {"draft.system_prompt", "polish.system_prompt"}

    async def test_fan_out_feedback_is_combined_once(self) -> None:
        module = FanOut().bind(AliasLM()).train()
        out = await module("q")
        report = await (await fail("weak")(out)).backward()
        (one,) = report.passes
        order = one.order
        assert order[0] == "Join_4" and order[-1] == "LLMInference_1"
        assert set(order[1:3]) == {"LLMInference_2", "LLMInference_3"}
        combined = one.node_feedback["LLMInference_1"]
        assert combined.content.count("[via LLMInference_") == 2
        assert combined.metadata["combined_from"] == ["LLMInference_2", "LLMInference_3"]
        assert combined.score == 0.0
        for param in module.parameters():
            assert len(param.get_accumulated_feedback()) == 1, param.name

    async def test_shared_module_accumulates_feedback_from_each_call(self) -> None:
        class Twice(Module):
            def __init__(self) -> None:
                super().__init__()
                self.step = LLMInference("fast", system_prompt=prompt("Improve.", "an improving step"))

            def forward(self, x: Any) -> Any:
                return self.step(self.step(x))

        module = Twice().bind(AliasLM()).train()
        await (await fail("still bad")(await module("x"))).backward()
        assert len(module.step.system_prompt.get_accumulated_feedback()) == 2

    async def test_frozen_parameters_get_nothing(self) -> None:
        module = Chain()
        module.draft.system_prompt.requires_grad = False
        module.bind(AliasLM()).train()
        report = await (await fail("no")(await module("x"))).backward()
        assert module.draft.system_prompt.get_accumulated_feedback() == []
        assert set(report.parameter_feedback) == {"polish.system_prompt"}

    async def test_feedback_from_run_with_record(self) -> None:
        module = Chain()
        output, record = await run(module, "x", resources=AliasLM(), record=True)
        feedback = await fail("bad")(output, record=record)
        await feedback.backward()
        assert len(module.polish.system_prompt.get_accumulated_feedback()) == 1


class TestParametersAsArguments:
    async def test_a_template_parameter_learns_through_render(self) -> None:
        class Templated(Module):
            def __init__(self) -> None:
                super().__init__()
                self.template = Parameter("Question: {q}", description="how the question is framed")
                self.llm = LLMInference("fast")

            def forward(self, q: Any) -> Any:
                return self.llm(F.render(self.template, {"q": q}))

        lm = AliasLM()
        module = Templated().bind(lm).train()
        out = await module("2+2")
        assert lm.prompts("fast") == ["Question: 2+2"]
        await (await fail("answer with a number")(out)).backward()
        (text,) = module.template.get_accumulated_feedback()
        assert "Question: {q}" in text and "how the question is framed" in text and "answer with a number" in text


class Scored(Module):
    """A leaf with its own backward: feedback only to `text`, a note on its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.rule = Parameter("be brief", description="the rule")

    def forward(self, text: str, style: str = "plain") -> str:
        return text

    async def backward(self, feedback: Any, ctx: BackwardContext) -> BackwardResult:
        assert set(ctx.inputs) == {"text", "style"}
        assert isinstance(ctx.inputs["text"], Value) and ctx.inputs["style"] == "loud"
        return BackwardResult(
            input_feedback={"text": Feedback(f"upstream: {feedback.content}", 0.2, FeedbackType.LLM_JUDGE)},
            parameter_feedback={"rule": f"rule note: {feedback.content}"},
        )


class TestCustomBackward:
    async def test_custom_backward_routes_and_names(self) -> None:
        class Outer(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("fast", system_prompt=prompt("S", "system"))
                self.check = Scored()

            def forward(self, x: Any) -> Any:
                return self.check(self.llm(x), style="loud")

        module = Outer().bind(AliasLM()).train()
        report = await (await fail("meh")(await module("x"))).backward()
        assert module.check.rule.get_accumulated_feedback() == ["rule note: meh"]
        (llm_text,) = module.llm.system_prompt.get_accumulated_feedback()
        assert "upstream: meh" in llm_text and "Score: 0.2" in llm_text
        assert report.passes[0].node_feedback["LLMInference_1"].content == "upstream: meh"

    async def test_unknown_names_are_errors(self) -> None:
        class Wrong(Module):
            def __init__(self, result: BackwardResult) -> None:
                super().__init__()
                self.result = result

            def forward(self, x: str) -> str:
                return x

            async def backward(self, feedback: Any, ctx: BackwardContext) -> BackwardResult:
                return self.result

        for result, match in [
            (BackwardResult(input_feedback={"nope": "x"}), r"input named 'nope'.*\['x'\]"),
            (BackwardResult(parameter_feedback={"ghost": "x"}), "parameter 'ghost'"),
        ]:
            module = Wrong(result).bind(AliasLM()).train()
            feedback = await fail("f")(await module("in"))
            with pytest.raises(ValueError, match=match):
                await feedback.backward()

    async def test_default_backward_of_a_python_leaf_feeds_its_parameters(self) -> None:
        class Suffix(Module):
            def __init__(self) -> None:
                super().__init__()
                self.suffix = Parameter("!", description="text appended to the answer")

            def forward(self, x: str) -> str:
                return x + str(self.suffix)

        module = Suffix().bind(AliasLM()).train()
        out = await module("hi")
        assert out == "hi!"
        await (await fail("use a period")(out)).backward()
        (text,) = module.suffix.get_accumulated_feedback()
        assert "text appended to the answer" in text and "hi!" in text and "use a period" in text

    async def test_independent_branches_run_backward_concurrently(self) -> None:
        running = peak = 0

        class Slow(Module):
            def forward(self, x: str) -> str:
                return x

            async def backward(self, feedback: Any, ctx: BackwardContext) -> BackwardResult:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.05)
                running -= 1
                return BackwardResult(input_feedback=dict.fromkeys(ctx.inputs, feedback))

        class Branches(Module):
            def __init__(self) -> None:
                super().__init__()
                self.left, self.right, self.join = Slow(), Slow(), Join()

            def forward(self, x: Any) -> Any:
                return self.join(self.left(x), self.right(x))

        module = Branches().bind(AliasLM()).train()
        await (await fail("f")(await module("x"))).backward()
        assert peak == 2


class TestBatchesAndReasoning:
    async def test_each_record_hears_its_own_items_feedback(self) -> None:
        module = Chain().bind(AliasLM()).train()
        outs = await module(["first", "second"])
        loss = VerifierLoss(lambda out: ("second" in out, "wrong topic"), success_feedback="right topic")
        feedback = await loss(outs)
        report = await feedback.backward()
        assert len(report.passes) == 2
        texts = module.draft.system_prompt.get_accumulated_feedback()
        assert len(texts) == 2
        by_input = {("first" if "Input: first" in t else "second"): t for t in texts}
        assert "wrong topic" in by_input["first"] and "Score: 0.0" in by_input["first"]
        assert "right topic" in by_input["second"] and "Score: 1.0" in by_input["second"]

    async def test_optimizer_reasoning_llm_adds_an_analysis(self) -> None:
        lm = AliasLM({"optimizer/reasoning": lambda r: "The prompt never asks for numbers."})
        module = Chain().bind(lm).train()
        optimizer = SFAOptimizer(module.parameters(), reasoning_model="any").bind(lm)
        await (await fail("give a number")(await module("x"))).backward(optimizer=optimizer)
        for param in module.parameters():
            (text,) = param.get_accumulated_feedback()
            assert "Analysis: The prompt never asks for numbers." in text
        assert len(lm.prompts("optimizer/reasoning")) == 2
        assert len(optimizer._records) == 1
