"""The converted-model cache: a GGUF file, once dequantised, is kept as an ordinary HF folder.

The folder (``config.json``, ``generation_config.json``, ``model.safetensors`` in float32, ``tokenizer.json``,
``tokenizer_config.json``) is keyed by the source's resolved path, size and mtime, so an edited or replaced file
misses the cache. It is written into a temporary folder and renamed into place, so a crash or a concurrent
loader never leaves a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.engine.config import ModelConfig
from app.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the cache layout or the conversion changes, so old entries are not reused.
CACHE_FORMAT_VERSION = 1
MARKER = "inf_engine_cache.json"


def default_cache_root() -> Path:
    """``<data_dir>/model-cache`` from the process settings (``INF_ENGINE_DATA_DIR``)."""
    from app.settings import get_settings  # the one settings object; imported lazily to keep the engine light

    return Path(get_settings().data_dir) / "model-cache"


def cache_key(source: Path) -> str:
    st = source.stat()
    ident = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def cache_path(source: Path, root: Path) -> Path:
    return root / f"{source.stem}-{cache_key(source)}"


def lookup(source: Path, root: Path) -> Path | None:
    """The cached folder for ``source`` if a complete entry exists."""
    path = cache_path(source, root)
    return path if (path / MARKER).is_file() else None


def store(
    source: Path,
    root: Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
) -> Path:
    """Write a cache entry atomically; returns its folder."""
    final = cache_path(source, root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        hf_config = config.to_hf_config()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        marker = {"source": str(source.resolve()), "format_version": CACHE_FORMAT_VERSION}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2), encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race (the target exists and is not empty): keep theirs.
            if not (final / MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("cached converted model %s at %s", source.name, final)
    return final
