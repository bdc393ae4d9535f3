"""Where demonstration candidates come from: the calls of examples that passed the metric (traces), and labelled
examples whose target is what an LLM call should answer (labels)."""

from __future__ import annotations

from typing import Any

from app.examples.extract import Extract
from app.examples.review_compare import ReviewCompare
from app.examples.sentiment import SentimentLabel
from app.pipeline import F, LLMInference, Module
from app.pipeline.optimization import (
    DemoCandidate,
    VerifierLoss,
    attach_demonstrations,
    candidates_from_examples,
    candidates_from_traces,
    evaluate,
)
from app.pipeline.resources.types import LLMRequest
from tests.support.fakes import ScriptedLM

TRAIN = [
    {"input": "Broke after a week.", "target": "negative"},
    {"input": "Love it!", "target": "positive"},
    {"input": "It is a kettle.", "target": "neutral"},
]


class Chain(Module):
    """A summary call, then a label call on the summary: only the first call's input is known before any LLM."""

    def __init__(self) -> None:
        super().__init__()
        self.summary = LLMInference("assistant", system_prompt="Summarise.")
        self.label = LLMInference("assistant", system_prompt="Label.")

    def forward(self, review: str) -> Any:
        summary = self.summary(F.render("Review: {r}", {"r": review}))
        return {"summary": summary, "label": self.label(summary)}


def test_labels_pair_the_call_input_with_the_target_where_the_call_makes_the_output() -> None:
    found = candidates_from_examples(SentimentLabel(), [*TRAIN, {"input": "No label."}, TRAIN[0]])
    assert found == {"classify": [
        DemoCandidate("classify", "Broke after a week.", "negative", "label", 0),
        DemoCandidate("classify", "Love it!", "positive", "label", 1),
        DemoCandidate("classify", "It is a kettle.", "neutral", "label", 2),
    ]}  # the example without a target and the repeated input are left out
    assert [c.demo() for c in found["classify"]][:1] == [{"input": "Broke after a week.", "output": "negative"}]
    record = {"sentiment": "mixed", "rating": 3, "would_recommend": False}
    (facts,) = candidates_from_examples(Extract(), [("Good but loud.", record)])["extract"]
    assert (facts.input, facts.output) == ("Good but loud.", record)  # a structured output's target is the record


def test_labels_follow_rendered_inputs_and_output_fields_but_not_inputs_made_by_an_llm() -> None:
    found = candidates_from_examples(Chain(), [{"input": "Too loud.", "target": {"summary": "Loud.", "label": "negative"}}])
    assert found == {"summary": [DemoCandidate("summary", "Review: Too loud.", "Loud.", "label", 0)]}
    # the verdict's input comes from two other calls, and the target has no fields for them: nothing
    assert candidates_from_examples(ReviewCompare(), [{"input": "Great.", "target": {"verdict": "positive"}}]) == {}
    assert candidates_from_examples(Chain(), [{"input": "x", "target": "a plain target for a dict output"}]) == {}


async def test_traces_give_each_calls_actual_input_and_output_when_the_example_passed() -> None:
    def reply(alias: str, request: LLMRequest) -> str:
        text = str(request.prompt)
        return "Short." if request.system_prompt == "Summarise." else ("negative" if "Short" in text else "?")

    module = Chain().bind(ScriptedLM(reply))
    module.train()
    outputs = [await module(review) for review in ("Too loud.", "Fine.", "Too loud.")]
    found = candidates_from_traces(outputs, [1.0, 0.5, 1.0])
    assert found == {
        "summary": [DemoCandidate("summary", "Review: Too loud.", "Short.", "trace", 0, 1.0)],
        "label": [DemoCandidate("label", "Short.", "negative", "trace", 0, 1.0)],
    }  # example 1 scored below the threshold, and example 2 repeats example 0
    assert candidates_from_traces(outputs, [0.5, 0.5, None]) == {}
    assert set(candidates_from_traces(outputs, [0.5, 0.5, 0.5], threshold=0.5)) == {"summary", "label"}
    assert candidates_from_traces(["no record"], [1.0]) == {}


async def test_an_evaluation_in_training_mode_feeds_the_traces_and_the_demos_reach_the_model() -> None:
    seen: list[Any] = []

    def reply(alias: str, request: LLMRequest) -> str:
        seen.append(request.prompt)
        return "negative" if "Broke" in str(request.prompt) or isinstance(request.prompt, list) else "positive"

    module = SentimentLabel().bind(ScriptedLM(reply))
    module.train()
    outputs = [await module(example["input"]) for example in TRAIN]
    result = await evaluate(module, TRAIN, VerifierLoss(lambda out, target: str(out) == target))
    assert result.scores == [1.0, 1.0, 0.0]
    (chosen,) = candidates_from_traces(outputs, result.scores)["classify"][:1]
    demos = attach_demonstrations(module)["classify"]
    demos.apply_update([chosen.demo()])
    seen.clear()
    await module("Anything.")
    assert seen == [[
        {"role": "user", "content": "Broke after a week."},
        {"role": "assistant", "content": "negative"},
        {"role": "user", "content": "Anything."},
    ]]
