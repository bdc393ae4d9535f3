"""train() and evaluate() on a small verifiable task whose scripted model only succeeds with the right prompt."""

from __future__ import annotations

from typing import Any

import pytest

from app.pipeline import LLMInference, Parameter
from app.pipeline.optimization import (
    LLMRubricLoss,
    SFAOptimizer,
    TrainingStep,
    VerifierLoss,
    evaluate,
    train,
)
from app.pipeline.resources import ConfigurationError
from app.pipeline.resources.types import LLMRequest

from .conftest import AliasLM, current_value

WORDS = ["apple", "brick", "cloud", "delta", "ember", "fjord"]
DATASET = [(w, w.upper()) for w in WORDS[:4]]
HELD_OUT = [{"input": w, "target": w.upper()} for w in WORDS[4:]]


def task_model(request: LLMRequest) -> str | BaseException:
    if request.prompt == "boom":
        return ValueError("the model crashed on this input")
    text = str(request.prompt)
    return text.upper() if "UPPERCASE" in (request.system_prompt or "") else text


def improve(request: LLMRequest) -> str:
    value = current_value(request)
    return value if "UPPERCASE" in value else value + " Reply in UPPERCASE."


def setup() -> tuple[LLMInference, AliasLM, SFAOptimizer, VerifierLoss]:
    lm = AliasLM({"task": task_model, "optimizer/updater": improve, "optimizer/aggregator": lambda r: "be upper"})
    module = LLMInference("task", system_prompt=Parameter("Repeat the text.", description="task instructions"))
    module.bind(lm)
    optimizer = SFAOptimizer(module.parameters()).bind(lm)
    loss = VerifierLoss(lambda out, target: (out == target, f"expected {target!r}, got {out!r}"))
    return module, lm, optimizer, loss


class TestTrain:
    async def test_training_fixes_the_prompt_and_reports_each_step(self) -> None:
        module, _, optimizer, loss = setup()
        steps: list[TrainingStep] = []
        history = await train(module, DATASET, loss, optimizer, epochs=2, batch_size=2, shuffle=True, seed=0,
                              eval_dataset=HELD_OUT, on_step=steps.append)
        assert history.eval_scores == [0.0, 1.0, 1.0]
        assert history.scores == [0.0, 1.0, 1.0, 1.0]
        assert history.initial_state == {"system_prompt": "Repeat the text."}
        assert history.final_state == {"system_prompt": "Repeat the text. Reply in UPPERCASE."}
        assert steps == history.steps and [s.step for s in steps] == [1, 2, 3, 4]
        (update,) = history.updates  # perfect batches have nothing to learn from: no further updates
        assert (update.old_value, update.new_value) == ("Repeat the text.", "Repeat the text. Reply in UPPERCASE.")
        assert update.feedback == "be upper" and update.scores == [0.0, 0.0]
        assert all("expected" in item for item in update.feedback_items)
        assert history.train_scores == [0.5, 1.0]
        assert module.training is False  # mode restored
        assert history.to_dict()["steps"][0]["updates"][0]["changed"] is True

    async def test_resources_given_to_train_serve_loss_and_optimizer(self) -> None:
        lm = AliasLM({"task": task_model, "optimizer/updater": improve,
                      "judge": lambda r: '{"score": 1, "justification": "", "feedback": "shout"}'})
        module = LLMInference("task", system_prompt=Parameter("Repeat.", description="task instructions"))
        loss = LLMRubricLoss("loudness", {1: "quiet", 2: "loud"})
        history = await train(module, DATASET[:1], loss, SFAOptimizer(module.parameters()), resources=lm)
        assert history.final_state == {"system_prompt": "Repeat. Reply in UPPERCASE."}
        assert len(lm.prompts("judge")) == 1 and len(lm.prompts("optimizer/updater")) == 1

    async def test_seed_fixes_the_order(self) -> None:
        def first_epoch_order(seed: int) -> Any:
            async def go() -> list[str]:
                module, lm, optimizer, loss = setup()
                await train(module, DATASET, loss, optimizer, epochs=1, batch_size=4, seed=seed)
                return lm.prompts("task")[:4]
            return go()

        assert await first_epoch_order(7) == await first_epoch_order(7)
        orders = {tuple(await first_epoch_order(s)) for s in range(6)}
        assert len(orders) > 1
        module, lm, optimizer, loss = setup()
        await train(module, DATASET, loss, optimizer, epochs=1, batch_size=4, shuffle=False)
        assert lm.prompts("task")[:4] == WORDS[:4]

    async def test_a_failing_example_is_reported_and_the_rest_still_train(self) -> None:
        module, _, optimizer, loss = setup()
        history = await train(module, [("boom", "BOOM"), ("apple", "APPLE")], loss, optimizer, batch_size=2,
                              shuffle=False)
        (step,) = history.steps
        assert step.errors == {0: "ValueError: the model crashed on this input"}
        assert step.scores == [None, 0.0] and step.score == 0.0
        assert "UPPERCASE" in module.system_prompt.value

    async def test_bad_arguments(self) -> None:
        module, _, optimizer, loss = setup()
        with pytest.raises(ValueError, match="epochs"):
            await train(module, DATASET, loss, optimizer, epochs=0)
        with pytest.raises(ValueError, match="batch_size"):
            await train(module, DATASET, loss, optimizer, batch_size=0)
        with pytest.raises(ValueError, match="non-empty"):
            await train(module, [], loss, optimizer)
        with pytest.raises(ValueError, match="'input'"):
            await train(module, [{"question": "q"}], loss, optimizer)

    async def test_missing_resources_raise_instead_of_failing_every_example(self) -> None:
        _, _, optimizer, loss = setup()
        unbound = LLMInference("task", system_prompt=Parameter("p", description="d"))
        with pytest.raises(ConfigurationError, match="task"):
            await train(unbound, DATASET, loss, optimizer)
        with pytest.raises(ConfigurationError, match="task"):
            await evaluate(unbound, DATASET, loss, resources={"other": {"provider": "openai", "model": "m"}})


class TestEvaluate:
    async def test_scores_per_example_with_failures_as_zero(self) -> None:
        module, _, _, loss = setup()
        module.system_prompt.value = "Answer in UPPERCASE."
        result = await evaluate(module, [("apple", "APPLE"), ("boom", "BOOM"), ("brick", "nope")], loss)
        assert result.scores == [1.0, None, 0.0]
        assert result.score == pytest.approx(1 / 3)
        assert result.failures == 1 and "crashed" in result.errors[1]
        assert result.to_dict()["feedback"][0] == "Output passed verification."
        assert result.outputs == ["APPLE", None, "BRICK"]  # each example's output value, None where it failed

    async def test_keyword_inputs(self) -> None:
        lm = AliasLM({"task": lambda r: str(r.prompt)})
        module = LLMInference("task").bind(lm)
        result = await evaluate(module, [{"inputs": {"prompt": "hi"}, "target": "hi"}],
                                VerifierLoss(lambda out, target: out == target))
        assert result.score == 1.0
