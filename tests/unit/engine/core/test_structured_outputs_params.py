"""``StructuredOutputsParams`` (exactly one constraint, each checked) and ``best_of`` on ``SamplingParams``."""

from __future__ import annotations

from typing import Any

import pytest

from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {
    "triggers": ["<tool_call>"],
    "structures": [{"begin": "<tool_call>", "schema": SCHEMA, "end": "</tool_call>"}],
}


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"json": SCHEMA}, "json"),
        ({"json": '{"type": "object"}'}, "json"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"json_object": True}, "json_object"),
        ({"structural_tag": TAG}, "structural_tag"),
    ],
)
def test_one_constraint(kwargs: dict[str, Any], kind: str) -> None:
    spec = StructuredOutputsParams(**kwargs)
    assert spec.kind == kind
    assert spec.value == next(iter(kwargs.values()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
        ({"json_object": False}, "got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex and choice"),
        ({"json": SCHEMA, "json_object": True}, "got json and json_object"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
        ({"structural_tag": {"triggers": []}}, "structural_tag.triggers must be a non-empty list"),
        ({"structural_tag": {"triggers": ["<a"], "structures": []}}, "structural_tag.structures must be"),
        (
            {
                "structural_tag": {
                    "triggers": ["<a"],
                    "structures": [{"begin": "<b>", "schema": {}, "end": "</b>"}],
                }
            },
            r"structures\[0\].begin '<b>' starts with none of the triggers",
        ),
        (
            {
                "structural_tag": {
                    "triggers": ["<a"],
                    "structures": [{"begin": "<a>", "schema": 1, "end": "</a>"}],
                }
            },
            r"structures\[0\].schema must be a JSON schema object",
        ),
    ],
)
def test_invalid_constraints(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict() -> None:
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})  # type: ignore[arg-type]
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.choice == ["x", "y"]
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"json_schema": {}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]


def test_best_of() -> None:
    assert SamplingParams().num_candidates == 1
    params = SamplingParams(n=2, best_of=5)
    assert params.num_candidates == 5 and params.needs_sample_logprob
    assert not SamplingParams(n=3, best_of=3).needs_sample_logprob
    with pytest.raises(ValueError, match=r"best_of must be an integer >= n \(3\)"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="best_of must be 1 when using greedy sampling"):
        SamplingParams(temperature=0.0, best_of=2)
    SamplingParams(temperature=0.0, best_of=1)  # fine, as in vLLM
    with pytest.raises(ValueError, match="cannot be streamed"):
        params.check_streamable()
    SamplingParams(n=2, best_of=2).check_streamable()


def test_scheduler_gives_constrained_sequences_no_lookahead_and_best_of_candidates() -> None:
    from app.engine.core.block_manager import BlockManager
    from app.engine.core.scheduler import Scheduler, SchedulerConfig
    from app.engine.core.sequence import Sequence, SequenceGroup

    scheduler = Scheduler(SchedulerConfig(num_lookahead_slots=3), BlockManager(64, 4, True))
    spec = StructuredOutputsParams(choice=["a"])
    free = Sequence("free", [5, 6, 7], SamplingParams(max_tokens=20))
    guided = Sequence("guided", [5, 6, 8], SamplingParams(max_tokens=20, structured_outputs=spec))
    best = SequenceGroup.from_sequence(
        Sequence("best", [9, 9], SamplingParams(n=2, best_of=4, max_tokens=20))
    )
    assert len(best.seqs) == 4  # best_of candidates, all sampled
    for request in (free, guided, best):
        scheduler.add(request)
    out = scheduler.schedule()  # prefills
    scheduler.update(out, {s.seq_id: 11 for s in out.scheduled})
    out = scheduler.schedule()  # decodes: the unconstrained ones may speculate
    assert out.num_lookahead_slots.get(free.seq_id) == 3
    assert guided.seq_id in out.num_scheduled_tokens and guided.seq_id not in out.num_lookahead_slots
