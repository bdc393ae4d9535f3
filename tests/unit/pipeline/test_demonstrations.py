"""Few-shot demonstrations as a parameter: what an LLM call sends with them, how a state saves and restores
them (attached ones included), and that traced graphs stay serialisable and hash them only when present."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from app.examples.review_compare import ReviewCompare
from app.examples.sentiment import SentimentLabel
from app.pipeline import Demonstrations, F, InferenceGraph, LLMInference, Module, Parameter, trace
from app.pipeline.optimization import attach_demonstrations
from app.pipeline.resources.types import LLMRequest
from tests.support.fakes import ScriptedLM

DEMOS = [
    {"input": "Broke after a week.", "output": "negative"},
    {"input": "Works as described.", "output": "neutral"},
    {"input": "Love it!", "output": "positive"},
]


class Facts(BaseModel):
    sentiment: str
    rating: int


class Declared(Module):
    """A pipeline that declares its own demonstrations, as it declares a learnable system prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.label = LLMInference(
            "assistant",
            system_prompt=Parameter("Label the review.", description="the instruction"),
            demos=Demonstrations(DEMOS, description="Labelled reviews shown before the review to label"),
            temperature=0.0,
        )

    def forward(self, review: str) -> Any:
        return self.label(F.render("Review: {r}", {"r": review}))


def recording_lm(answer: str = "positive") -> tuple[ScriptedLM, list[list[dict[str, Any]]]]:
    sent: list[list[dict[str, Any]]] = []

    def reply(alias: str, request: LLMRequest) -> str:
        sent.append(request.messages())
        return answer

    return ScriptedLM(reply), sent


# -- rendering ---------------------------------------------------------------------------------------------------
async def test_demonstrations_are_turns_between_the_system_prompt_and_the_input() -> None:
    lm, sent = recording_lm()
    assert await Declared().bind(lm)("Too loud.") == "positive"
    assert sent == [[
        {"role": "system", "content": "Label the review."},
        {"role": "user", "content": "Broke after a week."},
        {"role": "assistant", "content": "negative"},
        {"role": "user", "content": "Works as described."},
        {"role": "assistant", "content": "neutral"},
        {"role": "user", "content": "Love it!"},
        {"role": "assistant", "content": "positive"},
        {"role": "user", "content": "Review: Too loud."},
    ]]


async def test_data_inputs_and_outputs_render_as_json_and_no_demos_change_nothing() -> None:
    demos = [{"input": {"title": "Kettle", "body": "Fast."}, "output": {"sentiment": "positive", "rating": 5}}]
    call = LLMInference("assistant", response_format=Facts, demos=demos)
    lm, sent = recording_lm('{"sentiment": "negative", "rating": 1}')
    assert await call.bind(lm)({"title": "Fan", "body": "Rattles."}) == {"sentiment": "negative", "rating": 1}
    assert sent[0] == [  # inputs as the real prompt renders (sorted keys); outputs in their own key order
        {"role": "user", "content": '{"body": "Fast.", "title": "Kettle"}'},
        {"role": "assistant", "content": '{"sentiment": "positive", "rating": 5}'},
        {"role": "user", "content": '{"body": "Rattles.", "title": "Fan"}'},
    ]
    assert call.demos is not None and call.demos.requires_grad is False  # a plain list is frozen, like a str prompt
    plain = LLMInference("assistant", system_prompt="s")
    lm, sent = recording_lm()
    await plain.bind(lm)("x")
    assert plain.demos is None and sent == [[{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]]


async def test_an_empty_attached_list_sends_the_plain_request() -> None:
    module = SentimentLabel()
    attach_demonstrations(module)
    lm, sent = recording_lm()
    await module.bind(lm)("Fine.")
    assert sent == [[{"role": "system", "content": "You read product reviews."}, {"role": "user", "content": "Fine."}]]


def test_values_are_checked_and_copied_on_every_assignment() -> None:
    given = [{"input": "a", "output": "b"}]
    demos = Demonstrations(given, description="d")
    given[0]["output"] = "changed"
    assert demos.value == [{"input": "a", "output": "b"}]
    for bad in ("text", {"input": "a", "output": "b"}, [{"input": "a"}], [{"input": "a", "output": "b", "x": 1}],
                [{"input": object(), "output": "b"}]):
        with pytest.raises(ValueError, match="demonstration"):
            demos.value = bad
    with pytest.raises(ValueError, match="description"):
        Demonstrations([])
    demos.apply_update([{"input": "c", "output": "d"}])
    assert demos.messages() == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert "Demonstrations(" in repr(demos)


# -- attaching and the parameter state --------------------------------------------------------------------------
def test_attach_adds_one_learnable_list_per_call_and_keeps_declared_ones() -> None:
    module = ReviewCompare()
    before = module.state_dict()
    attached = attach_demonstrations(module)
    assert sorted(attached) == ["complaints", "praise", "verdict"]
    assert all(d.requires_grad and d.value == [] and d.description for d in attached.values())
    assert "'verdict'" in str(attached["verdict"].description)
    assert module.state_dict() == {**before, "praise.demos": [], "complaints.demos": [], "verdict.demos": []}
    assert attach_demonstrations(module) == attached  # attaching again changes nothing
    declared = Declared()
    assert attach_demonstrations(declared) == {"label": declared.label.demos}
    assert list(declared.state_dict()) == ["label.system_prompt", "label.demos"]
    root = LLMInference("assistant")
    assert attach_demonstrations(root) == {"": root.demos} and list(root.state_dict()) == ["system_prompt", "demos"]


def test_a_state_with_attached_demos_round_trips_through_json_into_a_fresh_instance() -> None:
    trained = SentimentLabel()
    attach_demonstrations(trained)["classify"].apply_update(DEMOS[:2])
    stored = json.loads(json.dumps(trained.state_dict()))  # what a parameter version keeps
    fresh = SentimentLabel()
    assert "classify.demos" not in fresh.state_dict()
    fresh.load_state_dict(stored)
    assert fresh.state_dict() == trained.state_dict() == stored
    assert fresh.classify.demos is not None and fresh.classify.demos.requires_grad
    assert fresh.classify.demo_messages() == trained.classify.demo_messages()
    assert fresh.classify._module_state_version == 1  # loading a changed value counts as a new state


def test_unknown_keys_are_refused_before_anything_is_attached() -> None:
    fresh = SentimentLabel()
    for state in ({"classify.demos": [], "classify.nope": 1}, {"nowhere.demos": []}, {"classify.system_prompt.x": 1}):
        with pytest.raises(KeyError, match="unknown parameter"):
            fresh.load_state_dict(state)
    assert fresh.classify.demos is None and list(fresh.state_dict()) == ["classify.system_prompt"]


# -- the traced graph -------------------------------------------------------------------------------------------
def test_graphs_serialise_and_hash_demos_only_when_there_are_some() -> None:
    module = SentimentLabel()
    plain = trace(module, "x").compute_hash()
    attach_demonstrations(module)
    assert trace(module, "x").compute_hash() == plain  # an empty list: the same graph as before
    module.classify.attach_demos().apply_update(DEMOS[:1])
    graph = trace(module, "x")
    assert graph.compute_hash() != plain
    document = json.loads(graph.to_json())
    (llm,) = [n for n in document["nodes"] if n["kind"] == "llm"]
    assert llm["config"]["demos"] == DEMOS[:1] and document["parameters"]["classify.demos"] == DEMOS[:1]
    rebuilt = InferenceGraph.from_dict(document, root=module)
    assert rebuilt.compute_hash() == graph.compute_hash()
