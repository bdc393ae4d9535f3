"""Feedback values: construction, checks, combination and records."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.pipeline import LLMInference, Parameter
from app.pipeline.optimization import Feedback, FeedbackType, combine_feedback
from app.pipeline.optimization.feedback import as_feedback

from .conftest import AliasLM


def test_fields_and_str() -> None:
    feedback = Feedback("too verbose", 0.6, FeedbackType.LLM_JUDGE, {"criteria": "brevity"})
    assert (feedback.content, feedback.score, feedback.feedback_type) == ("too verbose", 0.6, FeedbackType.LLM_JUDGE)
    assert str(feedback) == "[0.60] too verbose"
    assert str(Feedback("add examples")) == "add examples"
    assert Feedback("x").feedback_type is FeedbackType.HUMAN and Feedback("x").metadata == {}
    assert Feedback("x", feedback_type="verifier").feedback_type is FeedbackType.VERIFIER  # type: ignore[arg-type]
    assert FeedbackType.COMPOSITE.value == "composite"


def test_scores_outside_the_unit_interval_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Feedback("x", 4.0)
    assert Feedback("x", 1).score == 1.0


def test_combining_fan_out_feedback() -> None:
    merged = combine_feedback(
        [Feedback("short", 0.2, FeedbackType.VERIFIER), Feedback("rude", 0.6, FeedbackType.LLM_JUDGE)],
        ["Check_2", "Judge_3"],
    )
    assert merged.content == "[via Check_2] short\n\n[via Judge_3] rude"
    assert merged.score == pytest.approx(0.4) and merged.feedback_type is FeedbackType.COMPOSITE
    single = Feedback("only")
    assert combine_feedback([single]) is single
    assert combine_feedback([Feedback("a"), Feedback("b", 0.5)]).score == 0.5
    with pytest.raises(ValueError):
        combine_feedback([])


def test_what_a_backward_may_return_for_an_input() -> None:
    parent = Feedback("p", 0.3, FeedbackType.LLM_JUDGE)
    text = as_feedback("be precise", parent)
    assert (text.content, text.score, text.feedback_type) == ("be precise", 0.3, FeedbackType.LLM_JUDGE)
    assert as_feedback(SimpleNamespace(content="c", score=0.9)).score == 0.9
    assert as_feedback(parent) is parent


async def test_records_attach_once_and_backward_uses_them() -> None:
    llm = LLMInference("fast", system_prompt=Parameter("S", description="system")).bind(AliasLM()).train()
    out = await llm("q")
    feedback = Feedback("fix it", 0.0).attach_record(out.record).attach_record(out.record).attach_record(None)
    assert feedback.records == [out.record]
    report = await feedback.backward()
    assert list(report.parameter_feedback) == ["system_prompt"]
    assert "fix it" in llm.system_prompt.get_accumulated_feedback()[0]
