"""Fixtures: tiny random-weight HF checkpoints (saved as folders) and the default SmolLM2 model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.engine_fixtures import tiny_model_folders


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (HF folder, the transformers model it was saved from)."""
    return tiny_model_folders(tmp_path_factory.mktemp("tiny_models"))


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
