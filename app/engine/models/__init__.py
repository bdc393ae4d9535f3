"""Engine models: paged-KV implementations of the Llama family and GPT-2."""

from __future__ import annotations

import torch

from app.engine.attention import AttentionMetadata, allocate_kv_cache
from app.engine.config import ModelConfig
from app.engine.models.base import PagedCausalLM
from app.engine.models.gpt2 import GPT2LMHeadModel
from app.engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[PagedCausalLM]] = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> PagedCausalLM:
    """A model for ``config`` whose weights are placeholders until ``load_hf_state_dict`` fills them."""
    try:
        cls = MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"no model for architecture {config.architecture!r}") from None
    return cls(config, dtype=dtype, device=device).eval()


__all__ = [
    "MODEL_CLASSES",
    "AttentionMetadata",
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "ModelConfig",
    "PagedCausalLM",
    "allocate_kv_cache",
    "build_model",
]
