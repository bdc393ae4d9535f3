"""Fixtures: the tiny byte-level BPE tokenizer of the tiny test models, and a grammar compiler over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.guided.backend import GrammarCompiler
from app.engine.tokenizer import Tokenizer
from tests.support.engine_models import EOS, VOCAB, write_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("guided_tokenizer")
    write_tiny_tokenizer(folder, VOCAB)
    return Tokenizer.from_pretrained(folder, eos_token_ids=[EOS])


@pytest.fixture
def compiler(tiny_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer, VOCAB, [EOS])
