"""Optimizers with a scripted updater: ordered updates seen in the prompts, conservatism, retries, aliases."""

from __future__ import annotations

from typing import Any

import pytest

from app.pipeline import ExecutionSettings, LLMInference, Module, Parameter, ResourceConfig
from app.pipeline.optimization import Optimizer, ParameterUpdate, SFAOptimizer, VerifierLoss
from app.pipeline.resources import ConfigurationError
from app.pipeline.resources.types import LLMRequest
from tests.support.pipeline_modules import FanOut

from .conftest import AliasLM, current_value


class Three(Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = LLMInference("fast", system_prompt=Parameter("A0", description="stage a"))
        self.b = LLMInference("fast", system_prompt=Parameter("B0", description="stage b"))
        self.c = LLMInference("fast", system_prompt=Parameter("C0", description="stage c"))

    def forward(self, x: Any) -> Any:
        return self.c(self.b(self.a(x)))


def bump(request: LLMRequest) -> str:
    return current_value(request).replace("0", "1")


def updater_lm(updater: Any = bump, latency: float = 0.0, **more: Any) -> AliasLM:
    return AliasLM({"optimizer/updater": updater, "optimizer/aggregator": lambda r: "merged feedback", **more},
                   latency=latency)


async def with_feedback(module: Module, lm: AliasLM, inputs: Any = "x", message: str = "wrong") -> None:
    module.bind(lm).train()
    out = await module(inputs)
    await (await VerifierLoss(lambda o: (False, message))(out)).backward()


def updater_prompt(lm: AliasLM, name: str) -> str:
    (found,) = [p for p in lm.prompts("optimizer/updater") if p.startswith(f"Parameter: {name}\n")]
    return found


class TestOrderedUpdates:
    async def test_each_level_sees_its_upstream_changes(self) -> None:
        lm = updater_lm()
        module = Three()
        await with_feedback(module, lm)
        optimizer = SFAOptimizer(module.parameters()).bind(lm)
        assert await optimizer.step() == {"a.system_prompt": "A1", "b.system_prompt": "B1", "c.system_prompt": "C1"}
        assert module.state_dict() == {"a.system_prompt": "A1", "b.system_prompt": "B1", "c.system_prompt": "C1"}
        # the updater was asked in graph order, and each prompt shows what changed upstream
        assert [p.split("\n")[0] for p in lm.prompts("optimizer/updater")] == [
            "Parameter: a.system_prompt", "Parameter: b.system_prompt", "Parameter: c.system_prompt"]
        a, b, c = (updater_prompt(lm, f"{n}.system_prompt") for n in "abc")
        assert "Upstream parameter" not in a
        assert "Upstream parameter: a.system_prompt\nPrevious value:\nA0\nUpdated value:\nA1" in b
        assert "Upstream parameter: a.system_prompt" in c and "Upstream parameter: b.system_prompt" in c
        assert "Updated value:\nB1" in c
        assert [(u.name, u.level, u.upstream) for u in optimizer.last_updates] == [
            ("a.system_prompt", 0, []),
            ("b.system_prompt", 1, ["a.system_prompt"]),
            ("c.system_prompt", 2, ["a.system_prompt", "b.system_prompt"]),
        ]

    async def test_independent_parameters_share_a_level_and_run_concurrently(self) -> None:
        lm = updater_lm(lambda r: current_value(r) + " v2", latency=0.05)
        module = FanOut()
        await with_feedback(module, lm)
        optimizer = SFAOptimizer(module.parameters()).bind(lm)
        await optimizer.step()
        levels = {u.name: u.level for u in optimizer.last_updates}
        assert levels == {"draft.system_prompt": 0, "style.system_prompt": 1, "facts.system_prompt": 1}
        assert lm.peak == 2  # the two critics' prompts were updated together
        style = updater_prompt(lm, "style.system_prompt")
        assert "Updated value:\nDraft. v2" in style and "Facts?" not in style

    async def test_plain_optimizer_updates_everything_at_once(self) -> None:
        lm = updater_lm(latency=0.05)
        module = Three()
        await with_feedback(module, lm)
        optimizer = Optimizer(module.parameters()).bind(lm)
        assert len(await optimizer.step()) == 3
        assert lm.peak == 3
        assert all("Upstream parameter" not in p for p in lm.prompts("optimizer/updater"))
        assert {u.level for u in optimizer.last_updates} == {0}


class TestUpdates:
    async def test_conservatism_is_in_the_prompt(self) -> None:
        lm = updater_lm()
        for conservatism, phrase in [(0.9, "smallest edit"), (0.1, "rewrite the value freely")]:
            module = Three()
            await with_feedback(module, lm)
            await SFAOptimizer(module.parameters(), conservatism=conservatism).bind(lm).step()
            last = lm.prompts("optimizer/updater")[-1]
            assert f"conservatism {conservatism:.2f}" in last and phrase in last
        with pytest.raises(ValueError, match="conservatism"):
            SFAOptimizer([], conservatism=1.5)

    async def test_empty_answers_are_retried(self) -> None:
        answers = iter(["", "   ", "```\nA better prompt\n```"])
        lm = updater_lm(lambda r: next(answers))
        llm = LLMInference("fast", system_prompt=Parameter("A", description="d"))
        await with_feedback(llm, lm)
        optimizer = SFAOptimizer(llm.parameters(), max_retries=3).bind(lm)
        assert await optimizer.step() == {"system_prompt": "A better prompt"}
        (update,) = optimizer.last_updates
        assert update.attempts == 3 and update.changed and update.error is None
        assert "previous answer could not be used: the answer was empty" in lm.prompts("optimizer/updater")[1]

    async def test_retries_exhausted_keep_the_old_value(self) -> None:
        lm = updater_lm(lambda r: "")
        llm = LLMInference("fast", system_prompt=Parameter("A", description="d"))
        await with_feedback(llm, lm)
        optimizer = SFAOptimizer(llm.parameters(), max_retries=2).bind(lm)
        assert await optimizer.step() == {}
        (update,) = optimizer.last_updates
        assert update.error is not None and "empty" in update.error and not update.changed
        assert update.attempts == 3 and llm.system_prompt.value == "A"
        assert llm.system_prompt.get_accumulated_feedback() == []

    async def test_several_feedback_items_are_aggregated(self) -> None:
        lm = updater_lm()
        llm = LLMInference("fast", system_prompt=Parameter("P0", description="the prompt"))
        await with_feedback(llm, lm, inputs=["q1", "q2"], message="too long")
        optimizer = SFAOptimizer(llm.parameters()).bind(lm)
        await optimizer.step()
        (aggregate,) = lm.prompts("optimizer/aggregator")
        assert aggregate.count("<feedback index=") == 2 and "q1" in aggregate and "q2" in aggregate
        assert "merged feedback" in lm.prompts("optimizer/updater")[0]
        (update,) = optimizer.last_updates
        assert update.feedback == "merged feedback" and len(update.feedback_items) == 2
        assert update.scores == [0.0, 0.0]

    async def test_on_update_receives_what_a_job_persists(self) -> None:
        seen: list[ParameterUpdate] = []

        async def persist(update: ParameterUpdate) -> None:
            seen.append(update)

        lm = updater_lm()
        module = Three()
        await with_feedback(module, lm)
        optimizer = SFAOptimizer(module.parameters(), on_update=persist).bind(lm)
        await optimizer.step()
        assert [(u.name, u.old_value, u.new_value) for u in seen] == [
            ("a.system_prompt", "A0", "A1"), ("b.system_prompt", "B0", "B1"), ("c.system_prompt", "C0", "C1")]
        record = seen[0].to_dict()
        assert record["changed"] is True and record["step"] == 1 and "wrong" in record["feedback"]
        assert optimizer.history == seen

    async def test_non_string_parameters_come_back_as_json(self) -> None:
        answers = iter(["five", "5"])
        lm = updater_lm(lambda r: next(answers))
        count = Parameter(3, description="how many examples to show")
        count.accumulate_feedback("show more examples")
        optimizer = Optimizer([count]).bind(lm)
        await optimizer.step()
        assert count.value == 5
        assert "holds a int" in lm.prompts("optimizer/updater")[1]

    async def test_nothing_to_do_and_zero_feedback(self) -> None:
        module = Three()
        optimizer = SFAOptimizer(module.parameters())
        assert await optimizer.step() == {}  # no feedback: no LLM needed
        module.a.system_prompt.accumulate_feedback("x")
        optimizer.zero_feedback()
        assert module.a.system_prompt.get_accumulated_feedback() == []


class TestAliases:
    async def test_bind_names_the_missing_aliases(self) -> None:
        resources = ResourceConfig({"fast": {"provider": "openai", "model": "m"},
                                    "optimizer/updater": {"provider": "openai", "model": "m"}})
        with pytest.raises(ConfigurationError, match=r"\['optimizer/aggregator'\]"):
            SFAOptimizer([]).bind(resources)
        with pytest.raises(ConfigurationError, match="optimizer/reasoning"):
            SFAOptimizer([], reasoning_model="m").bind({**resources.to_dict(),
                                                        "optimizer/aggregator": {"provider": "openai", "model": "m"}})

    async def test_step_without_resources_is_a_clear_error(self) -> None:
        llm = LLMInference("fast", system_prompt=Parameter("A", description="d"))
        llm.system_prompt.accumulate_feedback("do better")
        optimizer = SFAOptimizer(llm.parameters())
        with pytest.raises(ConfigurationError, match=r"optimizer.bind\(resources\)"):
            await optimizer.step()
        async with ExecutionSettings(resources={"fast": {"provider": "openai", "model": "m"}}):
            with pytest.raises(ConfigurationError, match="optimizer/aggregator"):
                await optimizer.step()
        async with ExecutionSettings(resources=updater_lm()):
            assert await optimizer.step() == {"system_prompt": "A"}
