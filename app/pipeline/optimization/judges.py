"""LLM judges: freeform critique, rubric scores, pairwise preference and n-way ranking.

Each judge is a private LLM call under an alias (default ``"judge"``). Structured answers are JSON, parsed and
validated (a rubric score must be a level of the rubric, a ranking a permutation); a bad answer is re-asked up to
``max_retries`` more times, then ``JudgeResponseError`` explains what the judge kept getting wrong.
"""

from __future__ import annotations

import json
from typing import Any, Self

from pydantic import BaseModel, field_validator

from app.pipeline.optimization.contrast import (
    RubricLevel,
    check_ranking,
    normalise_rubric,
    preference_feedback,
    ranking_feedback,
    rubric_score,
    rubric_text,
)
from app.pipeline.optimization.feedback import Feedback, FeedbackType
from app.pipeline.optimization.llm import AnswerProblem, ChatLLM, non_empty, parse_model, schema_hint
from app.pipeline.optimization.loss import Loss
from app.pipeline.record import split_output


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(value)


def _sections(*pairs: tuple[str, Any]) -> str:
    return "\n\n".join(f"{title}:\n{_text(body)}" for title, body in pairs if body not in (None, "", {}, []))


class _JudgeLoss(Loss):
    feedback_type = FeedbackType.LLM_JUDGE

    def __init__(self, alias: str, system_prompt: str, max_retries: int, max_tokens: int | None) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.alias = alias
        self.max_retries = max_retries
        self.judge = ChatLLM(alias, system_prompt, owner=type(self).__name__, max_tokens=max_tokens)

    def bind(self, resources: Any) -> Self:
        self.judge.bind(resources)
        return self


class LLMJudge(_JudgeLoss):
    """Freeform critique from an LLM (``score`` is None): what is wrong and how to improve it."""

    def __init__(self, alias: str = "judge", criteria: str | None = None, *, max_retries: int = 2,
                 max_tokens: int | None = None) -> None:
        self.criteria = criteria
        super().__init__(
            alias,
            "You are a critical reviewer. Give specific, actionable feedback on how the output could be "
            "improved; be constructive, but name every weakness.",
            max_retries,
            max_tokens,
        )

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        prompt = _sections(("Output to critique", output), ("Context", context),
                           ("Expected behaviour", target), ("Focus on", self.criteria))
        prompt += "\n\nGive detailed, actionable feedback."
        critique = await self.judge.ask(prompt, non_empty, attempts=self.max_retries + 1, what="a critique")
        return Feedback(critique, None, FeedbackType.LLM_JUDGE, {"criteria": self.criteria})


class RubricAnswer(BaseModel):
    score: int
    justification: str = ""
    feedback: str

    @field_validator("score", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        # "4" and 4.0 are fine; 4.5 is not a rubric level
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        return value


class LLMRubricLoss(_JudgeLoss):
    """An LLM scores the output on a rubric (Likert scale); the score is mapped onto [0, 1]."""

    def __init__(self, criteria: str, rubric: Any, alias: str = "judge", *, max_retries: int = 2,
                 max_tokens: int | None = None) -> None:
        self.criteria = criteria
        self.rubric: list[RubricLevel] = normalise_rubric(rubric)
        super().__init__(
            alias,
            "You evaluate outputs against a rubric.\n\n"
            f"Criteria: {criteria}\n\nRating scale:\n{rubric_text(self.rubric)}\n\n"
            f"{schema_hint(RubricAnswer)} \"score\" is one of the scale's numbers, \"justification\" says why, "
            "\"feedback\" says concretely how to improve the output.",
            max_retries,
            max_tokens,
        )

    def _parse(self, text: str) -> RubricAnswer:
        answer = parse_model(text, RubricAnswer)
        allowed = [level.score for level in self.rubric]
        if answer.score not in allowed:
            raise AnswerProblem(f'"score" must be one of {allowed}, got {answer.score}')
        return answer

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        prompt = _sections(("Output to evaluate", output), ("Expected / reference", target), ("Context", context))
        # the format again at the end of the user turn: small models follow the last instruction they read
        allowed = ", ".join(str(level.score) for level in self.rubric)
        prompt += (f"\n\nRate the output on {self.criteria}. Reply with JSON only: "
                   f'{{"score": <one of {allowed}>, "justification": "<why>", "feedback": "<how to improve it>"}}')
        answer = await self.judge.ask(prompt, self._parse, attempts=self.max_retries + 1,
                                      what="a valid rubric evaluation")
        content = f"Justification: {answer.justification}\n\nFeedback: {answer.feedback}".strip()
        return Feedback(
            content,
            rubric_score(self.rubric, answer.score),
            FeedbackType.LLM_JUDGE,
            {"raw_score": answer.score, "criteria": self.criteria},
        )


class PreferenceAnswer(BaseModel):
    winner: str
    reason: str
    a_strengths: str = ""
    a_weaknesses: str = ""
    b_strengths: str = ""
    b_weaknesses: str = ""

    @field_validator("winner", mode="before")
    @classmethod
    def _a_or_b(cls, value: Any) -> Any:
        text = str(value).strip().strip("\"'").upper()
        for prefix in ("OUTPUT ", "RESPONSE "):
            text = text.removeprefix(prefix)
        if text not in ("A", "B"):
            raise ValueError('must be "A" or "B"')
        return text


class LLMPreferenceLoss(_JudgeLoss):
    """An LLM picks the better of two outputs. ``compare(a, b)`` gives feedback for both; as a loss,
    ``await loss(output, target=baseline)`` compares the output with a baseline (the target)."""

    def __init__(self, criteria: str, alias: str = "judge", *, max_retries: int = 2,
                 max_tokens: int | None = None) -> None:
        self.criteria = criteria
        super().__init__(
            alias,
            f"You compare two outputs, A and B, on: {criteria}. Decide which is better. "
            f"{schema_hint(PreferenceAnswer)} \"winner\" is \"A\" or \"B\"; \"reason\" explains the choice.",
            max_retries,
            max_tokens,
        )

    async def compare(
        self,
        output_a: Any,
        output_b: Any,
        *,
        record_a: Any = None,
        record_b: Any = None,
        context: Any = None,
    ) -> tuple[Feedback, Feedback]:
        value_a, record_a = split_output(output_a, record_a)
        value_b, record_b = split_output(output_b, record_b)
        prompt = _sections(("Context", context), ("Output A", value_a), ("Output B", value_b))
        prompt += ("\n\nWhich output is better? Reply with JSON only: "
                   '{"winner": "A" or "B", "reason": "<why>", "a_weaknesses": "...", "b_weaknesses": "..."}')
        answer = await self.judge.ask(prompt, lambda t: parse_model(t, PreferenceAnswer),
                                      attempts=self.max_retries + 1, what="a valid preference")
        fb_a, fb_b = preference_feedback(
            answer.winner, value_a, value_b, reason=answer.reason, kind=FeedbackType.LLM_JUDGE,
            notes=answer.model_dump(),
        )
        return fb_a.attach_record(record_a), fb_b.attach_record(record_b)

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        if target is None:
            raise ValueError("LLMPreferenceLoss compares the output with a baseline: pass the baseline as target")
        fb_output, _ = await self.compare(output, target, context=context)
        return fb_output


class RankingAnswer(BaseModel):
    ranking: list[int]
    best_qualities: str = ""
    worst_issues: str = ""
    comparison: str = ""
    per_output_feedback: list[str] = []


class LLMRankingLoss(_JudgeLoss):
    """An LLM ranks several outputs best to worst; each gets a score by rank (best 1.0, worst 0.0).
    ``rank(outputs)`` gives feedback for all; as a loss, ``await loss(output, target=[others...])`` ranks the
    output among the others. ``n`` is the usual group size (a hint for callers that sample candidates)."""

    def __init__(self, criteria: str, n: int = 4, alias: str = "judge", *, max_retries: int = 2,
                 max_tokens: int | None = None) -> None:
        if n < 2:
            raise ValueError(f"a ranking compares at least 2 outputs, got n={n}")
        self.criteria = criteria
        self.n = n
        super().__init__(
            alias,
            f"You rank outputs from best to worst on: {criteria}. {schema_hint(RankingAnswer)} \"ranking\" lists "
            "the output numbers, best first, each exactly once; \"per_output_feedback\" has one improvement note "
            "per output, in the order the outputs were given.",
            max_retries,
            max_tokens,
        )

    async def rank(self, outputs: list[Any], *, records: list[Any] | None = None,
                   context: Any = None) -> list[Feedback]:
        if len(outputs) < 2:
            raise ValueError(f"LLMRankingLoss needs at least 2 outputs to rank, got {len(outputs)}")
        split = [split_output(out, (records or [None] * len(outputs))[i]) for i, out in enumerate(outputs)]
        listing = "\n\n".join(f"[{i + 1}]\n{_text(value)}" for i, (value, _) in enumerate(split))
        prompt = _sections(("Context", context), ("Outputs to rank", listing))
        prompt += (f"\n\nRank these {len(outputs)} outputs from best to worst. Reply with JSON only: "
                   '{"ranking": [<output numbers, best first>], "best_qualities": "...", "worst_issues": "...", '
                   '"per_output_feedback": ["<note on output 1>", ...]}')

        def parse(text: str) -> RankingAnswer:
            answer = parse_model(text, RankingAnswer)
            try:
                answer.ranking = check_ranking(answer.ranking, len(outputs))
            except ValueError as exc:
                raise AnswerProblem(str(exc)) from None
            return answer

        answer = await self.judge.ask(prompt, parse, attempts=self.max_retries + 1, what="a valid ranking")
        feedbacks = ranking_feedback(
            [value for value, _ in split], answer.ranking, kind=FeedbackType.LLM_JUDGE,
            best=answer.best_qualities, worst=answer.worst_issues, comparison=answer.comparison,
            per_output=answer.per_output_feedback,
        )
        return [fb.attach_record(rec) for fb, (_, rec) in zip(feedbacks, split, strict=True)]

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        if target is None:
            raise ValueError("LLMRankingLoss ranks the output among others: pass them as target=[...]")
        others = target if isinstance(target, list | tuple) else [target]
        return (await self.rank([output, *others], context=context))[0]
