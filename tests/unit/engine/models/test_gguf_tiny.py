"""The GGUF path end to end on tiny models written the way llama.cpp's converter writes them.

Weights are quantised (Q8_0 / Q4_1 / F16 / F32 by tensor), q/k rows permuted (Llama), Conv1D weights transposed
(GPT-2), and the HF reference model is given the same round-tripped values, so our GGUF load must reproduce its
logits. Also covers the GGUF tokenizer and the converted cache.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine.loading import cache, load_model
from app.engine.tokenizer import Tokenizer
from tests.support.engine_models import VOCAB, PagedRunner, build_hf_model, write_tiny_tokenizer

pytest.importorskip("gguf")
from tests.support.gguf_files import write_gguf


@pytest.fixture(scope="module", params=["llama_gqa_llama3", "llama_mqa_tied_linear", "gpt2"])
def tiny_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, Path]:
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf = build_hf_model(request.param)
    write_tiny_tokenizer(root, VOCAB)
    path = root / f"{request.param}.gguf"
    write_gguf(hf, root / "tokenizer.json", path)
    return path, hf, root


def test_gguf_logits_match_transformers(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    path, hf, _ = tiny_gguf
    model, _, config = load_model(path, cache_dir=tmp_path)
    prompt = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = PagedRunner(model, block_size=8)
    ours = runner.step([(0, prompt)])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1:]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)


def test_gguf_tokenizer_matches_tokenizer_json(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    path, _, root = tiny_gguf
    _, tok, _ = load_model(path, cache_dir=tmp_path)
    original = Tokenizer.from_pretrained(root)
    texts = [
        "the quick brown fox",
        "héllo wörld 你好!",
        "<|im_start|>user\nhi<|im_end|>",
        "  spaces  x<extra_3>",
    ]
    for text in texts:
        assert tok.encode(text) == original.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_id == original.token_to_id("<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_converted_cache_is_reused_and_invalidated(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    path, _, _ = tiny_gguf
    m1, _, _ = load_model(path, cache_dir=tmp_path)
    entry = cache.lookup(path, tmp_path)
    assert entry is not None and (entry / "model.safetensors").is_file()
    m2, tok2, _ = load_model(path, cache_dir=tmp_path)  # from the cache
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert tok2.eos_token_id is not None
    # A changed file (new mtime) misses the old entry.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache.lookup(path, tmp_path) is None
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.lookup(path, tmp_path) == entry


def test_gguf_decode_matches_prefill(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    """Decoding token by token over the GGUF-loaded weights equals one prefill of the whole sequence."""
    path, _, _ = tiny_gguf
    model, _, _ = load_model(path, cache_dir=tmp_path)
    seq = list(range(5, 25))
    runner = PagedRunner(model, block_size=4)
    runner.step([(0, seq[:3])])
    for t in seq[3:-1]:
        runner.step([(0, [t])])
    last = runner.step([(0, [seq[-1]])])
    meta_ref = PagedRunner(model, block_size=4).step([(0, seq)])
    torch.testing.assert_close(last, meta_ref, atol=1e-5, rtol=0)
