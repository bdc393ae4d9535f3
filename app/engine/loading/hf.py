"""Reading a Hugging Face model folder: config, generation config, safetensors weights, tokenizer."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from app.engine.config import ModelConfig
from app.engine.tokenizer import Tokenizer

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_hf_config(folder: Path) -> ModelConfig:
    """``config.json`` (+ ``generation_config.json`` for the stop ids) as a :class:`ModelConfig`."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder: no config.json")
    gen_path = folder / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else None
    return ModelConfig.from_hf_config(read_json(cfg_path), gen)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the sharded index's files if there is an index, else every ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise ValueError(f"{folder} has only pickle weights (*.bin); convert them to safetensors first")
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a ``.safetensors`` file, read with ONE sequential read into one buffer.

    Faster than the library's mmap path here: touching mmapped pages one by one costs more than a single
    ``readinto``. Tensors are views into the buffer. Formats we do not map fall back to the library.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise ValueError(f"{path} is not a safetensors file (header length {header_len})")
        header = json.loads(f.read(header_len))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        if any(e.get("dtype") not in _ST_DTYPES for e in entries.values()):
            return load_file(str(path), device="cpu")
        buf = torch.empty(size - 8 - header_len, dtype=torch.uint8)
        view: Any = buf.numpy()  # a writable buffer readinto can fill in place
        if f.readinto(view) != buf.numel():
            raise ValueError(f"{path} is truncated")
    out: dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        dtype = _ST_DTYPES[e["dtype"]]
        start, end = (int(x) for x in e["data_offsets"])
        raw = buf[start:end]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if start % itemsize:
            raw = raw.clone()  # misaligned for a dtype view: copy to an aligned buffer
        out[name] = raw.view(dtype).view([int(d) for d in e["shape"]])
    return out


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        part = read_safetensors(path)
        dup = set(part) & set(state)
        if dup:
            raise ValueError(f"{path.name} repeats tensors from another shard: {sorted(dup)[:4]}")
        state.update(part)
    return state


def read_hf_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    return Tokenizer.from_pretrained(folder, eos_token_ids=config.eos_token_ids)
