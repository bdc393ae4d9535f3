"""Losses with scripted judges: verifier, freeform judge, rubric, preference, ranking, composite; batches."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.pipeline import ExecutionSettings, LLMInference, Parameter
from app.pipeline.optimization import (
    CompositeLoss,
    Feedback,
    FeedbackType,
    JudgeResponseError,
    LLMJudge,
    LLMPreferenceLoss,
    LLMRankingLoss,
    LLMRubricLoss,
    Loss,
    RubricLevel,
    VerifierLoss,
)
from app.pipeline.resources import ConfigurationError

from .conftest import AliasLM

RUBRIC = [RubricLevel(1, "Poor", "wrong"), RubricLevel(3, "Fair", "partly right"), RubricLevel(5, "Good", "right")]


class TestVerifierLoss:
    async def test_pass_and_fail(self) -> None:
        loss = VerifierLoss(lambda out: ("error" not in out, "the output mentions an error"))
        ok = await loss("all fine")
        bad = await loss("an error happened")
        assert (ok.score, ok.content, ok.feedback_type) == (1.0, "Output passed verification.", FeedbackType.VERIFIER)
        assert (bad.score, bad.content) == (0.0, "the output mentions an error")

    async def test_verifier_with_target_async_and_partial_scores(self) -> None:
        async def overlap(out: str, target: str) -> tuple[float, str]:
            words = set(target.split())
            return len(words & set(out.split())) / len(words), "missing words"

        loss = VerifierLoss(overlap, success_feedback="all there")
        half = await loss("a x", "a b")
        full = await loss("a b", "a b")
        assert half.score == 0.5 and half.content == "missing words"
        assert full.score == 1.0 and full.content == "all there"

    async def test_bad_verdicts_are_clear_errors(self) -> None:
        with pytest.raises(TypeError, match="bool"):
            await VerifierLoss(lambda out: "yes")("x")
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            await VerifierLoss(lambda out: 3)("x")

    async def test_batch_is_evaluated_concurrently_and_averaged(self) -> None:
        running, peak = 0, 0

        async def slow(out: str) -> bool:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.05)
            running -= 1
            return out == "good"

        feedback = await VerifierLoss(slow)(["good", "bad", "good", "good"])
        assert peak == 4
        assert feedback.score == pytest.approx(0.75)
        assert [f.score for f in feedback.items] == [1.0, 0.0, 1.0, 1.0]
        assert feedback.metadata["batch_size"] == 4

    async def test_batch_targets_must_match(self) -> None:
        loss = VerifierLoss(lambda out, target: out == target)
        assert (await loss(["a", "b"], ["a", "c"])).score == 0.5
        assert (await loss(["a", "a"], "a")).score == 1.0  # one target for every output
        with pytest.raises(ValueError, match="one target per output"):
            await loss(["a", "b"], ["a"])

    async def test_custom_loss_subclass(self) -> None:
        class Length(Loss):
            async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
                return Feedback(f"{len(output)} characters", min(1.0, len(output) / 10))

        assert (await Length()("hello")).score == 0.5


class TestLLMJudge:
    async def test_freeform_critique(self) -> None:
        lm = AliasLM({"judge": lambda r: "Be more specific about dates."})
        judge = LLMJudge(criteria="accuracy").bind(lm)
        feedback = await judge("It happened long ago.", target="1066", context={"topic": "history"})
        assert feedback.content == "Be more specific about dates."
        assert feedback.score is None and feedback.feedback_type is FeedbackType.LLM_JUDGE
        prompt = lm.prompts("judge")[0]
        assert "It happened long ago." in prompt and "1066" in prompt and "accuracy" in prompt and "history" in prompt

    async def test_empty_answer_is_asked_again_then_an_error(self) -> None:
        answers = iter(["", "  ", "Now a real critique."])
        lm = AliasLM({"judge": lambda r: next(answers)})
        assert (await LLMJudge().bind(lm)("x")).content == "Now a real critique."
        assert len(lm.prompts("judge")) == 3
        with pytest.raises(JudgeResponseError, match="empty"):
            await LLMJudge(max_retries=1).bind(AliasLM({"judge": lambda r: ""}))("x")

    async def test_resources_from_execution_settings_or_a_clear_error(self) -> None:
        with pytest.raises(ConfigurationError, match=r"bind\(resources\)"):
            await LLMJudge()("x")
        lm = AliasLM({"judge": lambda r: "fine"})
        async with ExecutionSettings(resources=lm):
            assert (await LLMJudge()("x")).content == "fine"

    async def test_missing_alias_in_a_resource_config(self) -> None:
        judge = LLMJudge(alias="critic").bind({"fast": {"provider": "openai", "model": "m"}})
        with pytest.raises(ConfigurationError, match="'critic'"):
            await judge("x")


class TestLLMRubricLoss:
    async def test_score_is_normalised_and_validated(self) -> None:
        lm = AliasLM({"judge": lambda r: 'Sure! ```json\n{"score": 3, "justification": "half", "feedback": "add x"}\n```'})
        loss = LLMRubricLoss("correctness", RUBRIC, alias="judge").bind(lm)
        feedback = await loss("answer", target="reference")
        assert feedback.score == 0.5 and feedback.metadata["raw_score"] == 3
        assert "add x" in feedback.content and "half" in feedback.content
        system = lm.requests[0][1].system_prompt or ""
        assert "correctness" in system and "5 - Good: right" in system

    async def test_a_score_outside_the_rubric_is_re_asked_with_the_problem(self) -> None:
        answers = iter(['{"score": 4, "feedback": "ok"}', '{"score": 5, "justification": "j", "feedback": "ok"}'])
        lm = AliasLM({"judge": lambda r: next(answers)})
        feedback = await LLMRubricLoss("c", RUBRIC).bind(lm)("answer")
        assert feedback.score == 1.0
        retry = lm.prompts("judge")[1]
        assert "must be one of [1, 3, 5]" in retry

    async def test_a_judge_that_never_answers_in_json_is_a_clear_error(self) -> None:
        lm = AliasLM({"judge": lambda r: "I would rate it highly."})
        loss = LLMRubricLoss("c", RUBRIC, max_retries=2).bind(lm)
        with pytest.raises(JudgeResponseError, match=r"LLMRubricLoss.*'judge'.*3 attempt.*no JSON object"):
            await loss("answer")
        assert len(lm.requests) == 3

    async def test_missing_fields_are_named(self) -> None:
        lm = AliasLM({"judge": lambda r: '{"score": 5}'})
        with pytest.raises(JudgeResponseError, match="feedback"):
            await LLMRubricLoss("c", RUBRIC, max_retries=0).bind(lm)("answer")

    def test_rubric_forms_and_checks(self) -> None:
        loss = LLMRubricLoss("c", {1: "bad", 2: "good"})
        assert [level.score for level in loss.rubric] == [1, 2]
        assert LLMRubricLoss("c", [(5, "top"), (0, "none", "nothing")]).rubric[0] == RubricLevel(0, "none", "nothing")
        with pytest.raises(ValueError, match="two levels"):
            LLMRubricLoss("c", [RubricLevel(1, "only")])
        with pytest.raises(ValueError, match="distinct"):
            LLMRubricLoss("c", [(1, "a"), (1, "b")])

    async def test_batch_items_are_judged_concurrently(self) -> None:
        def grade(request: Any) -> str:
            score = 5 if "right" in str(request.prompt) else 1
            return json.dumps({"score": score, "justification": "", "feedback": "f"})

        lm = AliasLM({"judge": grade}, latency=0.05)
        feedback = await LLMRubricLoss("c", RUBRIC).bind(lm)(["right", "wrong", "right", "wrong"])
        assert lm.peak == 4
        assert feedback.score == 0.5 and [f.score for f in feedback.items] == [1.0, 0.0, 1.0, 0.0]


class TestLLMPreferenceLoss:
    async def test_compare_gives_both_sides_feedback(self) -> None:
        answer = {"winner": "b", "reason": "B cites a source", "a_weaknesses": "no source", "b_strengths": "sourced"}
        lm = AliasLM({"judge": lambda r: json.dumps(answer)})
        loss = LLMPreferenceLoss("trustworthiness").bind(lm)
        fb_a, fb_b = await loss.compare("claim", "claim [1]")
        assert (fb_a.score, fb_b.score) == (0.0, 1.0)
        assert "B cites a source" in fb_a.content and "no source" in fb_a.content and "claim [1]" in fb_a.content
        assert "sourced" in fb_b.content
        prompt = lm.prompts("judge")[0]
        assert prompt.index("Output A:\nclaim") < prompt.index("Output B:\nclaim [1]")

    async def test_as_a_loss_against_a_baseline(self) -> None:
        lm = AliasLM({"judge": lambda r: '{"winner": "A", "reason": "shorter"}'})
        feedback = await LLMPreferenceLoss("brevity").bind(lm)("short", target="a much longer answer")
        assert feedback.score == 1.0
        with pytest.raises(ValueError, match="baseline"):
            await LLMPreferenceLoss("brevity").bind(lm)("short")

    async def test_invalid_winner_is_rejected(self) -> None:
        lm = AliasLM({"judge": lambda r: '{"winner": "C", "reason": "?"}'})
        with pytest.raises(JudgeResponseError, match='"A" or "B"'):
            await LLMPreferenceLoss("x", max_retries=0).bind(lm).compare("a", "b")


class TestLLMRankingLoss:
    async def test_rank_scores_by_position(self) -> None:
        answer = {"ranking": [2, 3, 1], "best_qualities": "concise", "worst_issues": "rambling",
                  "comparison": "ok", "per_output_feedback": ["cut it", "", "tighten"]}
        lm = AliasLM({"judge": lambda r: json.dumps(answer)})
        feedbacks = await LLMRankingLoss("clarity", n=3).bind(lm).rank(["long", "short", "medium"])
        assert [f.score for f in feedbacks] == [0.0, 1.0, 0.5]
        assert [f.metadata["rank"] for f in feedbacks] == [3, 1, 2]
        assert "rambling" in feedbacks[0].content and "short" in feedbacks[0].content and "cut it" in feedbacks[0].content
        assert "concise" in feedbacks[1].content
        assert "[1]\nlong" in lm.prompts("judge")[0]

    async def test_ranking_must_be_a_permutation(self) -> None:
        answers = iter(['{"ranking": [1, 1]}', '{"ranking": [2, 1]}'])
        lm = AliasLM({"judge": lambda r: next(answers)})
        feedback = await LLMRankingLoss("c", n=2).bind(lm)("mine", target=["other"])
        assert feedback.score == 0.0
        assert "exactly once" in lm.prompts("judge")[1]

    async def test_needs_others(self) -> None:
        with pytest.raises(ValueError, match="others"):
            await LLMRankingLoss("c").bind(AliasLM())("mine")
        with pytest.raises(ValueError, match="at least 2"):
            LLMRankingLoss("c", n=1)


class TestCompositeLoss:
    async def test_weighted_score_and_listing(self) -> None:
        lm = AliasLM({"judge": lambda r: '{"score": 5, "justification": "", "feedback": "great"}'})
        composite = CompositeLoss([(VerifierLoss(lambda o: (False, "not JSON")), 1.0),
                                   (LLMRubricLoss("c", RUBRIC), 3.0)]).bind(lm)
        feedback = await composite("output")
        assert feedback.score == pytest.approx(0.75)
        assert feedback.feedback_type is FeedbackType.COMPOSITE
        assert "not JSON" in feedback.content and "great" in feedback.content
        assert [c["weight"] for c in feedback.metadata["components"]] == [1.0, 3.0]

    async def test_unscored_components_do_not_dilute_the_score(self) -> None:
        lm = AliasLM({"judge": lambda r: "free text critique"})
        composite = CompositeLoss([(VerifierLoss(lambda o: True), 0.5), (LLMJudge(), 0.5)]).bind(lm)
        feedback = await composite("x")
        assert feedback.score == 1.0 and "free text critique" in feedback.content

    async def test_llm_aggregator(self) -> None:
        lm = AliasLM({"merge": lambda r: "one merged critique"})
        composite = CompositeLoss([VerifierLoss(lambda o: (False, "bad format")), VerifierLoss(lambda o: True)],
                                  aggregator=LLMInference("merge")).bind(lm)
        feedback = await composite("x")
        assert feedback.content == "one merged critique" and feedback.score == 0.5
        assert "bad format" in lm.prompts("merge")[0]

    def test_bad_weights(self) -> None:
        with pytest.raises(ValueError, match="at least one"):
            CompositeLoss([])
        with pytest.raises(ValueError, match=">= 0"):
            CompositeLoss([(VerifierLoss(lambda o: True), -1.0)])
        with pytest.raises(ValueError, match="all be zero"):
            CompositeLoss([(VerifierLoss(lambda o: True), 0.0)])


class TestRecords:
    async def test_training_outputs_carry_their_record_into_feedback(self) -> None:
        llm = LLMInference("fast", system_prompt=Parameter("p", description="d")).bind(AliasLM())
        llm.train()
        out = await llm("q")
        feedback = await VerifierLoss(lambda o: True)(out)
        assert feedback.records == [out.record]
        batch = await llm(["a", "b"])
        feedback = await VerifierLoss(lambda o: True)(batch)
        assert [i.records for i in feedback.items] == [[batch[0].record], [batch[1].record]]
        assert len(feedback.records) == 2

    async def test_plain_outputs_have_no_record(self) -> None:
        feedback = await VerifierLoss(lambda o: True)("q")
        assert feedback.records == []
        with pytest.raises(RuntimeError, match="training mode"):
            await feedback.backward()
