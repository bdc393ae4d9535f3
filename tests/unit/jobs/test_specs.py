"""The declarative parts of training and evaluation requests: dataset examples, loss specs, metrics, optimizers."""

from __future__ import annotations

from typing import Any

import pytest

from app.jobs.errors import InvalidJobInput, PayloadTooLarge
from app.jobs.learning.specs import (
    build_loss,
    dataset_file_id,
    dataset_name,
    examples_from_jsonl,
    loss_spec_of,
    make_check,
    named_examples,
    parse_examples,
    parse_optimizer,
    require_scores,
)
from app.pipeline import Parameter
from app.pipeline.optimization import (
    CompositeLoss,
    HumanFeedbackLoss,
    HumanRubricLoss,
    LLMJudge,
    LLMPreferenceLoss,
    LLMRubricLoss,
    Optimizer,
    QueueFeedbackSource,
    SFAOptimizer,
    VerifierLoss,
)


def starts_with_yes(output: Any) -> tuple[bool, str]:
    """A verifier function this module registers as the metric ``starts-with-yes``."""
    ok = str(output).lower().startswith("yes")
    return ok, "" if ok else "Start with yes."


def length_loss(limit: int = 10) -> VerifierLoss:
    """A loss factory this module registers as ``length``, built with options."""
    return VerifierLoss(lambda output: len(str(output)) <= limit)


def not_a_loss(**options: Any) -> str:
    return "no"


# what an operator's module declares (INF_ENGINE_PIPELINE_MODULES)
METRICS = {"starts-with-yes": starts_with_yes}
LOSSES = {"length": length_loss, "needs-options": length_loss, "not-a-loss": not_a_loss}


@pytest.fixture(autouse=True)
def _registered(register_modules: Any) -> None:
    register_modules(__name__)


@pytest.mark.parametrize(
    ("check", "output", "target", "passed"),
    [
        ("exact", "Positive.", "positive", True),
        ("exact", "  positive  ", "positive", True),
        ("exact", "It is positive", "positive", False),
        ("contains", "It is positive", "positive", True),
        ("contains", "It is negative", "positive", False),
        ("number", "The answer is 1,234.0 apples", "1234", True),
        ("number", "about 12", "13", False),
        ("number", "no digits", "1", False),
        ("regex", "Order #A-17 shipped", r"#[A-Z]-\d+", True),
        ("regex", "nothing here", r"\d", False),
    ],
)
def test_checks(check: str, output: str, target: str, passed: bool) -> None:
    ok, message = make_check(check)(output, target)
    assert ok is passed
    assert (message == "") is passed  # a failure always says what was expected


def test_check_options() -> None:
    assert make_check("exact", case_sensitive=True)("Positive", "positive")[0] is False
    assert make_check("regex", pattern=r"^\d+$")("42", None)[0] is True
    nested = {"verdict": {"label": "positive"}, "liked": "the screen"}
    assert make_check("exact", field="verdict.label")(nested, "positive")[0] is True
    with pytest.raises(ValueError, match=r"no field 'verdict\.score'"):
        make_check("exact", field="verdict.score")(nested, "positive")
    with pytest.raises(ValueError, match="needs a target"):
        make_check("exact")("positive", None)
    ok, message = make_check("exact")({"a": 1}, "x")  # structured outputs compare as JSON text
    assert not ok and '{"a": 1}' in message


async def test_verifier_spec_scores_a_batch() -> None:
    loss = build_loss({"type": "verifier", "check": "exact"}).loss
    feedback = await loss(["positive", "no idea"], ["positive", "negative"])
    assert feedback.score == 0.5
    assert "should be exactly 'negative'" in feedback.content


def test_loss_types_build_the_framework_losses() -> None:
    rubric = build_loss({"type": "rubric", "criteria": "clarity", "rubric": {"1": "unclear", "5": "clear"},
                         "alias": "grader", "max_retries": 1})
    assert isinstance(rubric.loss, LLMRubricLoss) and rubric.aliases == ["grader"]
    assert [level.score for level in rubric.loss.rubric] == [1, 5]
    listed = build_loss({"type": "rubric", "criteria": "c", "rubric": [[1, "bad"], [3, "ok", "fine"]]})
    assert [level.label for level in listed.loss.rubric] == ["bad", "ok"]  # type: ignore[attr-defined]
    judge = build_loss({"type": "judge"})
    assert isinstance(judge.loss, LLMJudge) and judge.aliases == ["judge"]
    preference = build_loss({"type": "preference", "criteria": "helpful"})
    assert isinstance(preference.loss, LLMPreferenceLoss)
    composite = build_loss({"type": "composite", "aggregator": "merger", "losses": [
        {"loss": {"type": "verifier", "check": "contains"}, "weight": 0.3},
        {"loss": {"type": "judge", "alias": "critic"}, "weight": 0.7},
    ]})
    assert isinstance(composite.loss, CompositeLoss) and composite.aliases == ["critic", "merger"]
    assert [w for _, w in composite.loss.losses] == [0.3, 0.7]
    function = build_loss({"type": "verifier", "function": "starts-with-yes"})
    assert isinstance(function.loss, VerifierLoss) and function.loss.verifier is starts_with_yes
    python = build_loss({"type": "python", "name": "length", "options": {"limit": 3}})
    assert isinstance(python.loss, VerifierLoss)
    older = build_loss({"type": "python", "path": "length"})  # the field's older name
    assert isinstance(older.loss, VerifierLoss)


def test_human_losses_need_a_source() -> None:
    with pytest.raises(InvalidJobInput, match="only available to trainings"):
        build_loss({"type": "human"})
    freeform = build_loss({"type": "human"}, human=QueueFeedbackSource)
    assert isinstance(freeform.loss, HumanFeedbackLoss) and freeform.human
    rubric = build_loss({"type": "human", "kind": "rubric", "criteria": "tone", "rubric": {"1": "rude", "3": "kind"}},
                        human=QueueFeedbackSource)
    assert isinstance(rubric.loss, HumanRubricLoss)
    nested = build_loss({"type": "composite", "losses": [{"loss": {"type": "human"}}]}, human=QueueFeedbackSource)
    assert nested.human


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("exact", "must be an object"),
        ({"type": "magic"}, "loss.type must be one of"),
        ({"type": "verifier", "check": "fuzzy"}, "loss.check must be one of"),
        ({"type": "verifier", "pattern": "("}, "not a valid regular expression"),
        ({"type": "verifier", "function": "no_such_metric"}, "unknown metric 'no_such_metric'.*starts-with-yes"),
        ({"type": "verifier", "function": "os:system"}, "unknown metric 'os:system'"),
        ({"type": "rubric", "criteria": "c"}, "rubric is required"),
        ({"type": "rubric", "criteria": "c", "rubric": {"1": "only one"}}, "at least two levels"),
        ({"type": "rubric", "rubric": {"1": "a", "2": "b"}}, "criteria must be a non-empty string"),
        ({"type": "judge", "max_retries": -1}, "max_retries must be a non-negative integer"),
        ({"type": "composite", "losses": []}, "losses must be a list"),
        ({"type": "composite", "losses": [{"loss": {"type": "judge"}, "weight": "heavy"}]}, "weight must be a number"),
        ({"type": "python", "name": "length", "options": {"nope": 1}}, "cannot be built with the options"),
        ({"type": "python", "name": "not-a-loss"}, "must name a Loss"),
        ({"type": "python", "path": "os:system", "options": {"command": "true"}}, "unknown loss 'os:system'"),
    ],
)
def test_bad_loss_specs_say_what_is_wrong(spec: Any, problem: str) -> None:
    with pytest.raises(InvalidJobInput, match=problem) as caught:
        build_loss(spec)
    assert caught.value.param == "loss"


def test_loss_or_metric() -> None:
    assert loss_spec_of(None, "exact") == {"type": "verifier", "check": "exact"}
    with pytest.raises(InvalidJobInput, match=r"unknown metric 'pkg\.mod:fn': registered metrics: exact") as caught:
        loss_spec_of(None, "pkg.mod:fn")
    assert caught.value.param == "metric"
    assert loss_spec_of(None, "starts-with-yes") == {"type": "verifier", "function": "starts-with-yes"}
    assert loss_spec_of({"type": "judge"}, None) == {"type": "judge"}
    assert loss_spec_of("contains", None) == {"type": "verifier", "check": "contains"}  # a loss by name
    assert loss_spec_of(None, {"type": "judge"}) == {"type": "judge"}  # a metric as a spec
    for loss, metric in ((None, None), ({"type": "judge"}, "exact")):
        with pytest.raises(InvalidJobInput, match="exactly one of"):
            loss_spec_of(loss, metric)


def test_examples() -> None:
    examples = parse_examples(
        [{"input": "a", "target": 1}, {"inputs": {"x": 1, "y": 2}}, ["b", "c"]], param="dataset", max_items=10
    )
    assert [(e.args, e.kwargs, e.target) for e in examples] == [
        (("a",), {}, 1), ((), {"x": 1, "y": 2}, None), (("b",), {}, "c"),
    ]
    with pytest.raises(InvalidJobInput, match=r"dataset\[1\]"):
        parse_examples([{"input": 1}, {"text": "no input"}], param="dataset", max_items=10)
    with pytest.raises(PayloadTooLarge, match="at most 2"):
        parse_examples([{"input": i} for i in range(3)], param="dataset", max_items=2)
    with pytest.raises(InvalidJobInput, match="non-empty list"):
        parse_examples({"input": 1}, param="dataset", max_items=2)
    lines = '{"input": "a", "target": "b"}\n\n{"input": "c"}\n'
    assert len(examples_from_jsonl(lines, source="f", param="dataset", max_items=5)) == 2
    with pytest.raises(InvalidJobInput, match="line 2 is not valid JSON"):
        examples_from_jsonl('{"input": 1}\n{oops\n', source="file x", param="dataset", max_items=5)
    assert dataset_file_id("file-abc") == "file-abc" and dataset_file_id({"file_id": "file-x"}) == "file-x"
    assert dataset_file_id([{"input": 1}]) is None


def test_a_registered_dataset_is_named_and_anything_else_stays_a_file_id() -> None:
    assert dataset_name("sentiment:train") == "sentiment:train"
    assert dataset_name({"name": "review-extract:test"}) == "review-extract:test"
    for other in ("file-abc", "/etc/passwd", "sentiment", [{"input": 1}], {"file_id": "file-x"}, {"name": 3}):
        assert dataset_name(other) is None  # never a path: an unregistered string is an uploaded file's id
    examples = named_examples("sentiment:validation", param="dataset", max_items=100)
    assert len(examples) == 80 and examples[0].target in ("positive", "negative")
    with pytest.raises(PayloadTooLarge, match="at most 10"):
        named_examples("sentiment:train", param="dataset", max_items=10)
    with pytest.raises(InvalidJobInput, match="unknown dataset 'nope:train': registered datasets: review-extract:test"):
        named_examples("nope:train", param="dataset", max_items=100)


def test_the_fields_check_scores_a_record_field_by_field() -> None:
    check = make_check("fields")
    target = {"sentiment": "mixed", "rating": 3, "would_recommend": False}
    assert check({"sentiment": "Mixed", "rating": 3, "would_recommend": False}, target) == (1.0, "")
    score, message = check('{"sentiment": "mixed", "rating": 4, "would_recommend": true}', target)
    assert score == pytest.approx(1 / 3)
    assert message == "Wrong fields: rating should be 3, got 4; would_recommend should be false, got true."
    assert check({"facts": {"sentiment": "mixed"}}, {"sentiment": "mixed"}) == (0.0, "Wrong fields: sentiment should be "
                                                                              '"mixed", got nothing.')
    assert make_check("fields", field="facts")({"facts": {"sentiment": "mixed"}}, {"sentiment": "mixed"})[0] == 1.0
    assert check("not json", target)[0] == 0.0
    assert loss_spec_of(None, "fields") == {"type": "verifier", "check": "fields"}


def test_optimizer_settings() -> None:
    assert parse_optimizer("basic").type == "basic"
    default = parse_optimizer(None)  # the selection-gated optimizer, with demonstrations
    assert default.selection and default.to_dict() == {
        "type": "gepa", "conservatism": 0.5, "max_tokens": 256, "budget": 600, "candidates_per_step": 4,
        "minibatch_size": 8, "max_demos": 4, "noise_z": 1.0, "demonstrations": True, "rewrite_instructions": True}
    assert parse_optimizer("sfa").to_dict() == {"type": "sfa", "conservatism": 0.7, "max_retries": 3,
                                                "max_tokens": 512, "reasoning_model": None}
    gepa = parse_optimizer({"type": "gepa", "budget": 900, "candidates_per_step": 2, "rewrite_instructions": False})
    assert (gepa.budget, gepa.candidates_per_step, gepa.aliases()) == (900, 2, [])
    param = Parameter("Answer.", description="instructions")
    sfa = parse_optimizer({"type": "sfa", "conservatism": 0.2, "max_retries": 1}).build([param])
    assert isinstance(sfa, SFAOptimizer) and sfa.conservatism == 0.2 and sfa.max_retries == 1
    basic = parse_optimizer({"type": "basic", "reasoning_model": "thinker"})
    built = basic.build([param])
    assert type(built) is Optimizer and basic.aliases() == [
        "optimizer/aggregator", "optimizer/updater", "optimizer/reasoning"]
    for bad, problem in ((5, "must be an object"), ({"type": "adam"}, "optimizer.type"),
                         ({"conservatism": 1.5}, "within \\[0, 1\\]"), ({"type": "sfa", "max_retries": 11}, "max_retries"),
                         ({"max_tokens": 0}, "max_tokens"), ({"lr": 0.1}, "unknown field"),
                         ({"budget": 0}, "optimizer.budget"), ({"candidates_per_step": True}, "candidates_per_step"),
                         ({"noise_z": -1}, "noise_z"), ({"demonstrations": "yes"}, "demonstrations"),
                         ({"type": "sfa", "budget": 10}, "unknown field"), ({"max_retries": 1}, "unknown field")):
        with pytest.raises(InvalidJobInput, match=problem):
            parse_optimizer(bad)


def test_the_selecting_optimizer_needs_a_loss_that_scores() -> None:
    for scored in ({"type": "verifier", "check": "exact"}, {"type": "rubric", "criteria": "x"},
                   {"type": "human", "kind": "rubric"},
                   {"type": "composite", "losses": [{"loss": {"type": "judge"}}, {"loss": {"type": "verifier"}}]}):
        require_scores(scored)
    for critique, named in (({"type": "judge"}, "a judge loss"), ({"type": "human"}, "a freeform human loss"),
                            ({"type": "composite", "losses": [{"loss": {"type": "judge"}, "weight": 1}]},
                             "a composite of unscored losses")):
        with pytest.raises(InvalidJobInput, match=f"{named} gives critique without a score") as raised:
            require_scores(critique)
        assert raised.value.param == "loss" and '{"type": "sfa"}' in str(raised.value)
