"""Compiling structured-output specs (every kind, the cache, the limits, errors) and per-sequence matchers
(sync: catch up, roll back, rebuild), on the tiny test tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.guided.backend import GrammarCompiler, grammar_key
from app.engine.guided.bitmask import bitmask_words, unpack_bitmask
from app.engine.guided.matcher import GuidedDecoding, SequenceMatcher
from app.engine.tokenizer import Tokenizer
from tests.support.engine_models import EOS, VOCAB

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


def allowed(matcher: SequenceMatcher) -> set[int]:
    bitmask = torch.full((1, bitmask_words(VOCAB)), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    return set(unpack_bitmask(bitmask, VOCAB)[0].nonzero().squeeze(1).tolist())


def walk(tok: Tokenizer, compiled: Any, text: str) -> SequenceMatcher:
    matcher = SequenceMatcher(compiled)
    for t in tok.encode(text, add_special_tokens=False):
        assert matcher.accept(t), text
    return matcher


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutputsParams(json=SCHEMA), '{"name":"fox","ok":true}', '{"name": 3'),
        (StructuredOutputsParams(json=json.dumps(SCHEMA)), '{"name":"","ok":false}', '{"ok": true'),
        (StructuredOutputsParams(json_object=True), '{"any": [1, {"x": null}]}', "[1"),
        (StructuredOutputsParams(regex=r"(ab|cd)+x"), "abcdx", "abx!"),
        (StructuredOutputsParams(choice=["brown fox", "lazy dog"]), "lazy dog", "lazy fox"),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"'), "(42)", "(4a"),
        (
            StructuredOutputsParams(
                structural_tag={
                    "triggers": ["<f="],
                    "structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}],
                }
            ),
            'the fox <f=a>{"name": "x", "ok": true}</f> done',
            "<f=a>{nope",
        ),
    ],
)
def test_each_kind_compiles_and_constrains(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer, spec: StructuredOutputsParams, good: str, bad: str
) -> None:
    compiled = compiler.compile(spec)
    matcher = walk(tiny_tokenizer, compiled, good)
    assert EOS in allowed(matcher)  # complete: the end is allowed
    assert matcher.accept(EOS) and matcher.is_terminated
    matcher = SequenceMatcher(compiled)
    assert not all(matcher.accept(t) for t in tiny_tokenizer.encode(bad, add_special_tokens=False))


def test_special_tokens_are_never_allowed(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    matcher = walk(tiny_tokenizer, compiler.compile(StructuredOutputsParams(json=SCHEMA)), '{"name":"a')
    mask = allowed(matcher)
    assert len(mask) > 100  # inside a string: almost anything
    assert not mask & {0, 1, EOS}  # but no special token (they would vanish from the detokenized text)


def test_cache_hits_and_keys(compiler: GrammarCompiler) -> None:
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    # The same schema as JSON text with the keys in another order: no second compile.
    text = json.dumps({"required": ["name", "ok"], "properties": SCHEMA["properties"], "type": "object"})
    assert compiler.compile(StructuredOutputsParams(json=text)) is first
    assert (compiler.num_compiles, compiler.num_hits) == (1, 1)
    compiler.compile(StructuredOutputsParams(regex="a+"))
    compiler.compile(StructuredOutputsParams(regex="a+"))
    assert (compiler.num_compiles, compiler.num_hits) == (2, 2)
    assert grammar_key(StructuredOutputsParams(json_object=True)) == ("json_object", "")


def test_lru_bound(tiny_tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS], cache_size=2)
    specs = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, 4)]
    for spec in specs:
        compiler.compile(spec)
    assert len(compiler) == 2
    compiler.compile(specs[2])  # still cached
    assert compiler.num_compiles == 3
    compiler.compile(specs[0])  # evicted: compiled again
    assert compiler.num_compiles == 4 and len(compiler) == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(json={"type": "objekt"}), r"structured_outputs\.json: invalid JSON schema"),
        (StructuredOutputsParams(regex="(ab"), r"structured_outputs\.regex: invalid regular expression"),
        (StructuredOutputsParams(grammar="root ::= ("), r"structured_outputs\.grammar: invalid EBNF grammar"),
        (
            StructuredOutputsParams(grammar='start ::= "a"'),
            r"structured_outputs\.grammar: invalid EBNF grammar",
        ),
    ],
)
def test_invalid_specs_name_the_field(
    compiler: GrammarCompiler, spec: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)
    assert compiler.num_compiles == 0 and len(compiler) == 0


def test_too_large_spec(tiny_tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS], max_spec_bytes=1000)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(100)}}
    with pytest.raises(
        ValueError, match=r"structured_outputs\.json: the json is \d+ bytes as text, more than"
    ):
        compiler.compile(StructuredOutputsParams(json=big))
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: .* more than the limit of 1000"):
        compiler.compile(StructuredOutputsParams(choice=["x" * 600, "y" * 600]))


def test_sync_catches_up_rolls_back_and_rebuilds(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    compiled = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    ids = tiny_tokenizer.encode('{"name":"ab","ok":true}', add_special_tokens=False)
    reference = [
        allowed(walk(tiny_tokenizer, compiled, tiny_tokenizer.decode(ids[:k]))) for k in range(len(ids))
    ]
    matcher = SequenceMatcher(compiled)
    matcher.sync(ids[:5])  # catch up
    assert matcher.accepted == ids[:5] and allowed(matcher) == reference[5]
    matcher.sync(ids[:2])  # roll back
    assert matcher.accepted == ids[:2] and allowed(matcher) == reference[2]
    matcher.sync(ids[:7])  # and forward again
    assert matcher.accepted == ids[:7] and allowed(matcher) == reference[7]

    choice = compiler.compile(StructuredOutputsParams(choice=["the fox", "lazy dog"]))
    fox, dog = (tiny_tokenizer.encode(w, add_special_tokens=False) for w in ("the fox", "lazy dog"))
    matcher = SequenceMatcher(choice)
    matcher.sync(fox)
    matcher.sync(dog)  # another history from the first token on: rebuilt from it
    assert matcher.accepted == dog and matcher.accept(EOS) and matcher.is_terminated


def test_guided_decoding_per_sequence(compiler: GrammarCompiler, tiny_tokenizer: Tokenizer) -> None:
    guided = GuidedDecoding(tiny_tokenizer, VOCAB, [EOS], compiler=compiler)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    a = Sequence("r", [5, 6], SamplingParams(structured_outputs=spec), eos_token_id=EOS)
    b = a.spawn(1)
    free = Sequence("s", [5, 6], SamplingParams(), eos_token_id=EOS)
    guided.add_request("r", [a, b], guided.compile(spec))
    mask = guided.bitmask_for([free, a, b])
    assert mask is not None and mask.rows == [1, 2]
    yes, no = (tiny_tokenizer.encode(w, add_special_tokens=False) for w in ("yes", "no"))
    finished: list[tuple[Sequence, SequenceStatus]] = []
    a.append_token(yes[0])
    b.append_token(no[0])
    guided.advance([a, b], [0, 0], lambda s, st: finished.append((s, st)))
    assert not finished
    bits = unpack_bitmask(guided.bitmask_for([a, b]).bitmask, VOCAB)  # type: ignore[union-attr]
    # Each sibling follows its own choice.
    assert set(bits[0].nonzero().squeeze(1).tolist()) != set(bits[1].nonzero().squeeze(1).tolist())
    guided.release("r")
    assert guided.bitmask_for([a, b]) is None and len(guided) == 0
