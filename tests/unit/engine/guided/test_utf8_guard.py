"""The UTF-8 guard: after a lead byte that xgrammar checks too loosely, only the continuation bytes UTF-8 allows."""

from __future__ import annotations

import json

import pytest
import torch

from app.engine.guided.backend import bounded_strings_as_patterns
from app.engine.guided.bitmask import bitmask_words, unpack_bitmask
from app.engine.guided.utf8 import Utf8Guard

xgr = pytest.importorskip("xgrammar")

BYTES = [0xE0, 0x80, 0x9F, 0xA0, 0xBF, 0xED, 0xF0, 0x8F, 0x90, 0xF4]
VOCAB = ['"', "a"] + [f"<0x{b:02X}>" for b in BYTES] + ["</s>"]


def _token(byte: int) -> int:
    return VOCAB.index(f"<0x{byte:02X}>")


def _allowed(guard: Utf8Guard, after: list[int]) -> set[int]:
    bitmask = torch.full((1, bitmask_words(len(VOCAB))), -1, dtype=torch.int32)
    guard.restrict(bitmask, 0, after)
    return {i for i, ok in enumerate(unpack_bitmask(bitmask, len(VOCAB))[0].tolist()) if ok}


def test_only_the_continuations_utf8_allows_follow_a_guarded_lead() -> None:
    guard = Utf8Guard([b'"', b"a", *(bytes([b]) for b in BYTES), b""], len(VOCAB))
    everything = set(range(len(VOCAB)))
    assert _allowed(guard, []) == everything and _allowed(guard, [1]) == everything
    after_e0 = _allowed(guard, [_token(0xE0)])
    assert _token(0x80) not in after_e0 and _token(0x9F) not in after_e0
    assert {_token(0xA0), _token(0xBF), 1} <= after_e0  # valid continuations, and anything not a continuation
    assert _token(0xA0) not in _allowed(guard, [_token(0xED)]) and _token(0x9F) in _allowed(guard, [_token(0xED)])
    assert _token(0x8F) not in _allowed(guard, [_token(0xF0)]) and _token(0x90) in _allowed(guard, [_token(0xF0)])
    assert _token(0x90) not in _allowed(guard, [_token(0xF4)]) and _token(0x8F) in _allowed(guard, [_token(0xF4)])


def test_with_the_grammar_no_overlong_sequence_can_be_decoded() -> None:
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.BYTE_FALLBACK, stop_token_ids=[len(VOCAB) - 1])
    schema = bounded_strings_as_patterns({"type": "string", "maxLength": 3})  # as the engine compiles it
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    guard = Utf8Guard([bytes(t) for t in info.decoded_vocab], len(VOCAB))
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_token(0) and matcher.accept_token(_token(0xE0))
    bitmask = torch.full((1, bitmask_words(len(VOCAB))), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert unpack_bitmask(bitmask, len(VOCAB))[0, _token(0x80)]  # xgrammar alone allows E0 80 (overlong)
    guard.restrict(bitmask, 0, [0, _token(0xE0)])
    allowed = unpack_bitmask(bitmask, len(VOCAB))[0]
    assert not allowed[_token(0x80)] and allowed[_token(0xA0)]
