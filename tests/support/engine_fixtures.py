"""Engine fixtures shared by the engine's runtime and framework tests (imported by their conftests): tiny
random-weight Llama and GPT-2 checkpoints (HF folders), the models loaded once, one torch thread, and engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine.llm_engine import LLMEngine
from tests.support.engine_models import TINY_CONFIGS, build_hf_model, save_hf_model

__all__ = ["_one_thread", "loaded", "make_engine", "tiny", "tiny_model_folders"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (HF folder, the transformers model saved there)."""
    return tiny_model_folders(tmp_path_factory.mktemp("engine_runtime_models"))


def tiny_model_folders(root: Path) -> dict[str, tuple[Path, Any]]:
    """Every tiny config saved as an HF folder under ``root``: name -> (folder, the transformers model)."""
    out: dict[str, tuple[Path, Any]] = {}
    for name, spec in TINY_CONFIGS.items():
        model = build_hf_model(name)
        out[name] = (save_hf_model(model, root / name, spec.get("shard")), model)
    return out


@pytest.fixture(scope="session")
def loaded(tiny: dict[str, tuple[Path, Any]]) -> dict[str, tuple[Any, Any, Any]]:
    """name -> (our model, tokenizer, model config), loaded once and shared by the engines of a test."""
    from app.engine.loading import load_model

    return {name: load_model(folder) for name, (folder, _) in tiny.items()}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning OpenMP
    threads make them ~40x slower. Restored afterwards: the setting is process-wide."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_engine(loaded: dict[str, tuple[Any, Any, Any]]) -> Callable[..., LLMEngine]:
    """``make_engine(name="llama_gqa_llama3", **engine_options)``: an engine with its own KV cache."""

    def make(name: str = "llama_gqa_llama3", **kwargs: Any) -> LLMEngine:
        model, tokenizer, config = loaded[name]
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 22)
        kwargs.setdefault("seed", 0)
        return LLMEngine.from_loaded(model, tokenizer, config, **kwargs)

    return make
