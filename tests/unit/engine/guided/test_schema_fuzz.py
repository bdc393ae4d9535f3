"""Generated JSON schemas against the compiler: a schema xgrammar itself compiles (no cache, as given) is never
refused by ours, whose cached compiler sees our rewrite of bounded strings. With xgrammar 0.2.8 this property
found dozens of refused schemas in 200 examples (its internal ``per_rule_fsm_hashes`` check), among them a string
of exactly 160 characters; the compiler now falls back to the schema as given."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

import app.engine.guided.backend as backend
from app.engine.core.sampling_params import StructuredOutputsParams
from app.engine.guided.backend import GrammarCompiler
from app.engine.tokenizer import Tokenizer
from tests.support.engine_models import EOS, VOCAB
from tests.support.json_schemas import json_schemas

xgr = pytest.importorskip("xgrammar")

STORY = {"type": "object", "required": ["story"],
         "properties": {"story": {"type": "string", "minLength": 160, "maxLength": 160}}}


@pytest.fixture(scope="module")
def shared(tiny_tokenizer: Tokenizer) -> tuple[GrammarCompiler, Any]:
    """One of our compilers for every example (its caches fill as a server's do) and xgrammar's tokenizer info."""
    ours = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS])
    ours.compile(StructuredOutputsParams(json_object=True))
    return ours, ours._info


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=json_schemas())
def test_a_schema_xgrammar_accepts_is_never_refused(shared: tuple[GrammarCompiler, Any], schema: dict[str, Any]) -> None:
    ours, info = shared
    try:
        xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema, any_whitespace=False)
    except Exception:
        return  # xgrammar refuses it as given: ours may refuse it too (with a 400 naming the reason)
    assert ours.compile(StructuredOutputsParams(json=schema)) is not None


def test_the_reported_schema_compiles(shared: tuple[GrammarCompiler, Any]) -> None:
    ours, _ = shared
    assert ours.compile(StructuredOutputsParams(json=STORY)) is not None


def test_a_rewrite_the_cached_compiler_refuses_falls_back_to_the_schema(
    tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = GrammarCompiler(tiny_tokenizer, VOCAB, [EOS])
    monkeypatch.setattr(backend, "bounded_strings_as_patterns", lambda schema: {"type": "no-such-type"})
    assert ours.compile(StructuredOutputsParams(json=STORY)) is not None
    with pytest.raises(ValueError, match="invalid JSON schema"):
        ours.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 7}}}))
