"""Structured outputs on a tiny random-weight Llama: whatever the (random) model prefers, every output
follows its grammar — JSON schema, JSON object, regex, choice, EBNF — with n > 1, preemption by recompute,
prefix caching, stop strings, speculative decoding in the same batch; errors at ``add_request``; the compile
cache; ``best_of``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from app.engine import LLMEngine, RequestOutput, SamplingParams, StructuredOutputsParams
from tests.support.engine_runtime import random_prompts

pytest.importorskip("xgrammar")

PROMPTS = random_prompts(4, 6, 20, seed=31)


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    friendly: bool


SCHEMA = Pet.model_json_schema()


def check_json_schema(text: str) -> None:
    Pet.model_validate_json(text, strict=True)
    try:
        import jsonschema_rs
    except ImportError:  # pydantic alone is enough; the JSON-schema validator is a second opinion
        return
    jsonschema_rs.validate(SCHEMA, json.loads(text))


def check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


CASES: dict[str, tuple[StructuredOutputsParams, Callable[[str], None]]] = {
    "json": (StructuredOutputsParams(json=SCHEMA), check_json_schema),
    "json_text": (StructuredOutputsParams(json=json.dumps(SCHEMA)), check_json_schema),
    "json_object": (StructuredOutputsParams(json_object=True), check_json_object),
    "regex": (
        StructuredOutputsParams(regex=r"[a-f]{2,6}-[0-9]{1,3}"),
        lambda t: assert_match(r"[a-f]{2,6}-[0-9]{1,3}", t),
    ),
    "choice": (
        StructuredOutputsParams(choice=["the quick fox", "lazy dog", "wörld"]),
        lambda t: assert_in(t, ["the quick fox", "lazy dog", "wörld"]),
    ),
    "grammar": (
        StructuredOutputsParams(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [0-9] | "fox"'),
        lambda t: assert_match(r"\((?:[0-9]|fox)(?:,(?:[0-9]|fox)){0,3}\)", t),
    ),
}


def assert_match(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), text


def assert_in(text: str, choices: list[str]) -> None:
    assert text in choices, text


def sampled(spec: StructuredOutputsParams, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("seed", 7)
    return SamplingParams(structured_outputs=spec, **kwargs)


def check_all(outputs: list[RequestOutput], check: Callable[[str], None], n: int) -> None:
    for output in outputs:
        assert len(output.outputs) == n
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            check(completion.text)


def _idle(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return (
        not engine.has_unfinished_requests()
        and bm.num_free_blocks == bm.num_blocks
        and not len(engine.guided)
    )


@pytest.mark.parametrize("case", list(CASES))
def test_every_kind_conforms_with_n2(make_engine: Callable[..., LLMEngine], case: str) -> None:
    spec, check = CASES[case]
    engine = make_engine()
    bias: dict[int, float] = {}
    if case == "json_object":
        # Any object is unbounded: a random model would write until max_tokens. Favouring the quote and the
        # closing brace makes it close strings and the object soon (where the grammar allows them).
        bias = {engine.tokenizer.token_to_id('"') or 0: 4.0, engine.tokenizer.token_to_id("}") or 0: 4.0}
    check_all(engine.generate(PROMPTS, sampled(spec, n=2, logit_bias=bias)), check, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec, logit_bias=bias)
    check_all(engine.generate(PROMPTS[:2], greedy), check, 1)
    assert _idle(engine)


def test_mixed_batch_leaves_unconstrained_requests_alone(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = engine.generate(PROMPTS, free)
    spec, check = CASES["json"]
    params = [free, sampled(spec), free, sampled(spec)]
    mixed = engine.generate(PROMPTS, params)
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    check_all([mixed[1], mixed[3]], check, 1)


def test_preemption_by_recompute_still_conforms(make_engine: Callable[..., LLMEngine]) -> None:
    spec, check = CASES["json"]
    prompts = random_prompts(8, 8, 20, seed=5)
    params = sampled(spec, n=2)
    roomy = make_engine(block_size=4)
    cfg = roomy.model_config
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    tight = make_engine(block_size=4, kv_cache_memory_bytes=32 * per_block)
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.get_stats().num_preemptions > 0
    check_all(got, check, 2)
    # Seeded sampling draws the same tokens whatever the batch: the matchers resumed exactly where they were.
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    assert _idle(tight)


def test_prefix_caching_unaffected(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(block_size=4)
    spec, check = CASES["regex"]
    prompt = random_prompts(1, 30, 30, seed=2)[0]
    first = engine.generate([prompt], sampled(spec))[0]
    second = engine.generate([prompt], sampled(spec))[0]
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids  # same seed, same tokens
    check_all([first, second], check, 1)


def test_stop_strings_still_apply(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    spec = StructuredOutputsParams(grammar='root ::= "the quick brown fox " [a-z]{1,5} "."')
    out = engine.generate(PROMPTS[:1], sampled(spec, stop=["brown"]))[0].outputs[0]
    assert out.text == "the quick " and out.finish_reason == "stop" and out.stop_reason == "brown"
    out = engine.generate(PROMPTS[:1], sampled(spec))[0].outputs[0]
    assert re.fullmatch(r"the quick brown fox [a-z]{1,5}\.", out.text) and out.stop_reason is None
    assert _idle(engine)


def test_max_tokens_truncates_with_length(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    spec = StructuredOutputsParams(grammar='root ::= "[" ("fox," ){20} "fox]"')
    out = engine.generate(PROMPTS[:1], sampled(spec, max_tokens=6))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith("[fox,") and not out.text.endswith("]")


def test_ignore_eos_still_ends_with_the_grammar(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    spec = StructuredOutputsParams(choice=["lazy dog"])
    out = engine.generate(PROMPTS[:1], sampled(spec, ignore_eos=True))[0].outputs[0]
    assert out.text == "lazy dog" and out.finish_reason == "stop"
    assert out.token_ids[-1] == engine.eos_token_id  # the grammar's end: nothing could follow it
    assert _idle(engine)


def test_invalid_or_too_large_spec_is_a_value_error_at_add(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objekt"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.json: invalid JSON schema"):
        engine.add_request("bad", PROMPTS[0], bad)
    huge = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)},
    }
    with pytest.raises(
        ValueError, match=r"structured_outputs\.json: the json is \d+ bytes as text, more than the limit"
    ):
        engine.add_request(
            "huge", PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(json=huge))
        )
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: invalid regular expression"):
        engine.generate(PROMPTS, [SamplingParams(), sampled(StructuredOutputsParams(regex="(a"))] * 2)
    assert _idle(engine) and engine.get_num_unfinished_requests() == 0


def test_identical_schemas_compile_once(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    compiler = engine.guided.compiler
    spec, check = CASES["json"]
    check_all(engine.generate(PROMPTS[:2], sampled(spec)), check, 1)
    check_all(
        engine.generate(PROMPTS[2:], sampled(StructuredOutputsParams(json=json.dumps(SCHEMA)))), check, 1
    )
    assert compiler.num_compiles == 1 and compiler.num_hits == 3


def test_speculation_is_off_for_constrained_rows(make_engine: Callable[..., LLMEngine]) -> None:
    spec_config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    plain = make_engine()
    engine = make_engine(speculative_config=spec_config)
    repetitive = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    json_spec, check = CASES["json"]
    params = [free, free, sampled(json_spec), sampled(json_spec, n=2)]
    got = engine.generate(repetitive * 2, params)
    check_all(got[2:3], check, 1)
    check_all(got[3:], check, 2)
    expected = plain.generate(repetitive, free)
    assert [o.outputs[0].token_ids for o in got[:2]] == [o.outputs[0].token_ids for o in expected]
    assert engine.get_stats().spec_decode_num_drafts > 0  # the unconstrained rows were still speculated
    assert _idle(engine)


def test_best_of_returns_the_top_n_by_cumulative_logprob(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    base = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    # The same seed draws the same candidates: first all four, with their cumulative logprobs...
    everything = engine.generate(PROMPTS[:2], SamplingParams(n=4, logprobs=0, **base))  # type: ignore[arg-type]
    best = engine.generate(PROMPTS[:2], SamplingParams(n=2, best_of=4, **base))  # type: ignore[arg-type]
    for all_out, best_out in zip(everything, best, strict=True):
        ranked = sorted(all_out.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
        assert [c.token_ids for c in best_out.outputs] == [c.token_ids for c in ranked[:2]]
        assert [c.index for c in best_out.outputs] == [0, 1]
        for got, want in zip(best_out.outputs, ranked, strict=False):
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
            assert got.logprobs is None  # not asked for: only used to rank
    assert _idle(engine)


def test_best_of_is_emitted_only_when_finished(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    params = SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=1)
    engine.add_request("b", PROMPTS[0], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs) == 1
    assert engine.get_stats().request_success == {"length": 3}  # three candidates were sampled


def test_best_of_with_structured_outputs(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    spec, check = CASES["json"]
    out = engine.generate(PROMPTS[:2], sampled(spec, n=2, best_of=3))
    check_all(out, check, 2)
    assert _idle(engine)


def test_bounded_strings_keep_their_bound_in_the_decoded_text(make_engine: Callable[..., LLMEngine]) -> None:
    """xgrammar alone lets overlong UTF-8 (``E0 80 80``) into strings; it decodes to several U+FFFD, which
    broke ``maxLength`` on byte-fallback vocabularies. The engine's UTF-8 guard keeps the bytes valid."""
    schema = {
        "type": "object",
        "properties": {"product": {"type": "string", "maxLength": 12}},
        "required": ["product"],
        "additionalProperties": False,
    }
    engine = make_engine()
    spec = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=1.5, max_tokens=80, n=4, seed=3, structured_outputs=spec)
    outputs = engine.generate(random_prompts(6, 4, 12, seed=5), params)
    texts = [c.text for out in outputs for c in out.outputs if c.finish_reason == "stop"]
    assert texts
    for text in texts:
        product = json.loads(text)["product"]
        assert len(product) <= 12 and "\ufffd" not in product, text


def test_a_budget_too_short_for_the_model_still_ends_in_valid_json(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A random model wanders in unbounded strings and arrays; near max_tokens the closer ends each output as a
    complete document (finish_reason "length" when the budget, not the model, ended it)."""
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        },
        "required": ["title", "tags", "meta"],
    }
    engine = make_engine()
    spec = StructuredOutputsParams(json=schema)
    reasons = []
    for max_tokens in (45, 60, 80):  # the shortest document takes 41 tokens of the tiny vocabulary
        outputs = engine.generate(PROMPTS, sampled(spec, max_tokens=max_tokens, n=2))
        for completion in (c for o in outputs for c in o.outputs):
            document = json.loads(completion.text)
            assert set(document) >= {"title", "tags", "meta"} and isinstance(document["meta"]["id"], int)
            assert len(completion.token_ids) <= max_tokens
            reasons.append(completion.finish_reason)
    assert "length" in reasons  # the random model did not finish on its own every time
    assert _idle(engine)
