"""Fixtures: tiny random-weight HF checkpoints (saved as folders) and the default SmolLM2 model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine.models.helpers import save_hf_model

VOCAB = 320

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads over 2 kv heads), separate lm_head, llama3 RoPE scaling that bites at short range.
    "llama_gqa_llama3": dict(
        kind="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Multi-query (one kv head), tied embeddings, linear RoPE scaling, attention biases, sharded safetensors.
    "llama_mqa_tied_linear": dict(
        kind="llama",
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        shard="60KB",
    ),
    "gpt2": dict(kind="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256),
}


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run this package on one intra-op thread, restored afterwards.

    The models here are small (tiny ones entirely, SmolLM2 at batch <= 3), so a second thread buys little;
    on a shared, oversubscribed machine OpenMP's spinning barriers made the same tests 10x slower and
    pushed them past the per-test timeout. Results do not depend on it: ours and the reference run alike.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_hf_model(name: str) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    spec = dict(TINY_CONFIGS[name])
    kind = spec.pop("kind")
    spec.pop("shard", None)
    torch.manual_seed(1234)
    # A larger init than the default 0.02 makes logits peaked, so greedy choices are not near-ties.
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=1, eos_token_id=2, **spec)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            max_position_embeddings=512,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            **spec,
        )
        model = LlamaForCausalLM(cfg)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (HF folder, the transformers model it was saved from)."""
    root = tmp_path_factory.mktemp("tiny_models")
    out: dict[str, tuple[Path, Any]] = {}
    for name, spec in TINY_CONFIGS.items():
        model = build_hf_model(name)
        out[name] = (save_hf_model(model, root / name, spec.get("shard")), model)
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default model loaded twice through a fresh converted cache (first: GGUF, second: cache)."""
    from app.engine.loading import default_model_path, load_model

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    cache_dir = tmp_path_factory.mktemp("model_cache")
    t0 = time.perf_counter()
    load_model(None, cache_dir=cache_dir)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tokenizer, config = load_model(None, cache_dir=cache_dir)
    second = time.perf_counter() - t0
    return {
        "path": path,
        "cache_dir": cache_dir,
        "model": model,
        "tokenizer": tokenizer,
        "config": config,
        "first_load_s": first,
        "second_load_s": second,
    }
