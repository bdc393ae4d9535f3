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
    """An uninitialised model for ``config`` (load weights with ``load_hf_state_dict``)."""
    try:
        cls = MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"no model for architecture {config.architecture!r}") from None
    # Build on the meta device: allocating (and randomly initialising) weights we overwrite anyway is slow.
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device).to(dtype)
    # inv_freq is a non-persistent buffer: recompute it (to_empty left it uninitialised), always float32.
    if hasattr(model, "inv_freq"):
        model.inv_freq = config.rope_inv_freq().to(device)
    return model.eval()


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
