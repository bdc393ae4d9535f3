"""The budget closer: its preference order, its pick from a mask row, and that following it from any state of
a JSON or pattern grammar ends in a complete, valid document within the estimate it gives."""

from __future__ import annotations

import json
import re

import pytest
import torch

from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.guided.backend import GrammarCompiler
from app.engine.guided.bitmask import bitmask_words
from app.engine.guided.closing import BudgetCloser, closing_preference
from app.engine.guided.matcher import GuidedDecoding, SequenceMatcher
from app.engine.tokenizer import Tokenizer
from tests.support.engine_models import EOS, VOCAB

pytest.importorskip("xgrammar")

OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "inner": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
    },
    "required": ["name", "tags", "inner", "email"],
}


def test_preference_order() -> None:
    def pref(token: bytes) -> int:
        return closing_preference(token, is_stop=False)

    chain = [
        closing_preference(b"", is_stop=True),
        pref(b'"}'),
        pref(b'"'),
        pref(b"]}"),
        pref(b":"),
        pref(b"name"),
    ]
    assert chain == sorted(chain) and len(set(chain)) == len(chain)
    assert pref(b"[]") < pref(b"[") < pref(b"[{")  # closes more
    assert pref(b':"') < pref(b':",')  # a comma would stay inside the opened string
    assert pref(b',"') < pref(b",")  # longer first
    assert pref(b"") > pref(b" the")  # an empty token is never picked


def test_pick_takes_the_best_allowed_token_and_none_from_an_empty_row() -> None:
    vocab = [b"a", b"@", b'"', b"}", b"aa", b"bb"]
    closer = BudgetCloser(vocab, len(vocab), stop_token_ids=[])
    row = torch.zeros(bitmask_words(len(vocab)), dtype=torch.int32)
    assert closer.pick(row) is None
    row[0] = 0b111011  # all but '"'
    assert closer.pick(row) == 3  # a closer before content
    row[0] = 0b110011  # content only: '@' is the rarest first byte
    assert closer.pick(row) == 1
    row[0] = 0b110001  # 'a' (2 tokens) and 'b' (1): the rarer group, longest token
    assert closer.pick(row) == 5
    assert (
        closer.pick(row, previous=5) == 4
    )  # not the first byte of the token before, while another is allowed


def _follow(closer: BudgetCloser, matcher: SequenceMatcher, limit: int) -> list[int]:
    """Tokens the closing policy forces from the matcher's state until the grammar ends (stop token included)."""
    picked: list[int] = []
    row = torch.zeros((1, bitmask_words(VOCAB)), dtype=torch.int32)
    previous = matcher.accepted[-1] if matcher.accepted else None
    while not matcher.is_terminated and len(picked) <= limit:
        matcher.fill(row, 0)
        closer.force(row, 0, previous)
        token = closer.pick(row[0])
        assert token is not None and matcher.accept(token)
        picked.append(token)
        previous = token
    return picked


@pytest.mark.parametrize(
    "prefix", ['{"name":"abcab', '{"name":"x","tags":["a', '{"name":"","tags":[],"inner":{', ""]
)
def test_closing_from_any_state_gives_a_valid_document_within_the_estimate(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer, prefix: str
) -> None:
    compiled = compiler.compile(StructuredOutputsParams(json=OPEN_SCHEMA))
    closer = BudgetCloser(compiler.decoded_vocab(), VOCAB, [EOS])
    matcher = SequenceMatcher(compiled)
    prefix_ids = tiny_tokenizer.encode(prefix, add_special_tokens=False)
    matcher.sync(prefix_ids)
    assert matcher.accepted == prefix_ids
    estimate = closer.tokens_to_close(
        matcher.matcher, limit=200, previous=prefix_ids[-1] if prefix_ids else None
    )
    assert estimate <= 200
    picked = _follow(closer, matcher, limit=200)
    assert picked[-1] == EOS and len(picked) == estimate + 1  # the estimate is exactly what closing takes
    document = json.loads(tiny_tokenizer.decode(prefix_ids + picked[:-1]))
    assert re.fullmatch(r"[a-z0-9.]+@[a-z0-9.]+", document["email"])
    assert isinstance(document["inner"]["n"], int) and isinstance(document["tags"], list)


def test_a_sequence_the_budget_closes_reports_length(
    compiler: GrammarCompiler, tiny_tokenizer: Tokenizer
) -> None:
    guided = GuidedDecoding(tiny_tokenizer, VOCAB, [EOS], compiler=compiler, max_model_len=1000)
    spec = StructuredOutputsParams(json=OPEN_SCHEMA)
    seq = Sequence("r", [5, 6], SamplingParams(structured_outputs=spec, max_tokens=60), eos_token_id=EOS)
    guided.add_request("r", [seq], guided.compile(spec))
    finished: list[SequenceStatus] = []
    while not finished and seq.num_output_tokens < 60:
        mask = guided.bitmask_for([seq])
        assert mask is not None
        allowed = [t for t in range(VOCAB) if mask.bitmask[0, t // 32] >> (t % 32) & 1]
        # a model that always prefers the longest allowed content (it would loop in "name" forever)
        token = max(allowed, key=lambda t: (len(tiny_tokenizer.decode([t])) if t != EOS else -1, t))
        before = seq.num_output_tokens
        seq.append_token(token)
        if token == EOS:
            seq.status = SequenceStatus.FINISHED_STOPPED  # what the scheduler does on eos
        guided.advance([seq], [before], lambda s, st: finished.append(st))
        if seq.is_finished:
            finished.append(seq.status)
    assert finished == [SequenceStatus.FINISHED_LENGTH]
    assert seq.output_token_ids[-1] == EOS and seq.num_output_tokens <= 60
    json.loads(tiny_tokenizer.decode(seq.output_token_ids[:-1]))
