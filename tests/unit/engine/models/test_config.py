"""ModelConfig from HF config.json dicts and GGUF metadata; RoPE frequencies equal transformers'."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.engine.config import ConfigError, ModelConfig, RopeScaling

LLAMA = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "eos_token_id": [7, 8],
    "bos_token_id": 1,
}


def test_llama_fields() -> None:
    cfg = ModelConfig.from_hf_config(LLAMA)
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 8, 2, 16)
    assert cfg.num_queries_per_kv == 4 and cfg.rope_theta == 500000.0
    assert cfg.eos_token_ids == (7, 8) and cfg.eos_token_id == 7 and cfg.bos_token_id == 1
    assert not cfg.tie_word_embeddings and cfg.activation == "silu"
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
    # generation_config.json's eos wins
    assert ModelConfig.from_hf_config(LLAMA, {"eos_token_id": 9}).eos_token_ids == (9,)


def test_gpt2_fields() -> None:
    cfg = ModelConfig.from_hf_config(
        {"model_type": "gpt2", "vocab_size": 500, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128}
    )
    assert (cfg.intermediate_size, cfg.head_dim, cfg.num_kv_heads, cfg.max_position_embeddings) == (
        256,
        16,
        4,
        128,
    )
    assert cfg.tie_word_embeddings and cfg.activation == "gelu_new" and cfg.layer_norm_eps == 1e-5


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"type": "linear", "factor": 4.0}},  # old style key
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_parameters": {  # transformers 5 style, theta inside
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
        {},
    ],
)
def test_rope_inv_freq_equals_transformers(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**LLAMA, **rope}
    ours = ModelConfig.from_hf_config(raw)
    hf_cfg = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    rope_type = hf_cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        dim = ours.head_dim
        ref = 1.0 / (
            hf_cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        )
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    assert torch.equal(ours.rope_inv_freq(), ref)


def test_hf_round_trip_through_to_hf_config() -> None:
    raw = {
        **LLAMA,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
    }
    cfg = ModelConfig.from_hf_config(raw)
    again = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert again == cfg
    factors = RopeScaling(freq_factors=tuple(float(i + 1) for i in range(8)))
    custom = ModelConfig.from_hf_config(LLAMA)
    custom = type(custom)(**{**custom.__dict__, "rope_scaling": factors})
    back = ModelConfig.from_hf_config(custom.to_hf_config())
    assert back.rope_scaling.freq_factors == factors.freq_factors
    assert torch.equal(back.rope_inv_freq(), custom.rope_inv_freq())


def test_gguf_metadata() -> None:
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.block_count": 4,
        "llama.context_length": 2048,
        "llama.embedding_length": 96,
        "llama.feed_forward_length": 192,
        "llama.attention.head_count": 6,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 2.0,
        "tokenizer.ggml.tokens": ["a"] * 300,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    cfg = ModelConfig.from_gguf_metadata(meta, ["token_embd.weight", "blk.0.attn_q.weight"])
    assert (cfg.vocab_size, cfg.num_layers, cfg.head_dim, cfg.num_kv_heads) == (300, 4, 16, 2)
    assert (
        cfg.tie_word_embeddings and cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0
    )
    assert cfg.eos_token_ids == (2,) and not cfg.attention_bias
    assert not ModelConfig.from_gguf_metadata(
        meta, ["token_embd.weight", "output.weight"]
    ).tie_word_embeddings


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**LLAMA, "model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "not supported"),
        ({**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({**LLAMA, "num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({**LLAMA, "hidden_act": "gelu"}, "activation"),
        (
            {
                "model_type": "gpt2",
                "vocab_size": 5,
                "n_embd": 8,
                "n_layer": 1,
                "n_head": 2,
                "scale_attn_by_inverse_layer_idx": True,
            },
            "scale_attn_by_inverse_layer_idx",
        ),
    ],
)
def test_unsupported_configs_are_clear_errors(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(raw)


def test_gguf_unknown_architecture() -> None:
    with pytest.raises(ConfigError, match="qwen3"):
        ModelConfig.from_gguf_metadata({"general.architecture": "qwen3"})
