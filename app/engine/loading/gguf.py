"""Reading a GGUF file (llama.cpp's format) into our config, an HF-named float32 state dict and a tokenizer.

Two GGUF conventions are undone here so the rest of the engine sees ordinary Hugging Face weights:

* llama.cpp permutes the rows of Llama's ``attn_q`` / ``attn_k`` within each head (it rotates interleaved
  pairs, HF rotates halves); we apply the inverse permutation.
* llama.cpp stores GPT-2's Conv1D weights transposed (``[out, in]``); we transpose back to HF's ``[in, out]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.engine.config import ConfigError, ModelConfig
from app.engine.loading.dequant import Q4_0, Q4_1, Q8_0, dequantize, q4_groups, q8_0_groups
from app.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# Big token/merge arrays are read only for the tokenizer, not copied into the metadata dict.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)

# llama.cpp token types.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT2_NAMES = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_GPT2_GLOBAL = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as llama.cpp splits text (llama-vocab.cpp).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_PRE_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"}
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen"}


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


class GGUFFile:
    """An opened GGUF file: decoded metadata and lazy access to its tensors."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader  # imported here: only GGUF loading needs the package

        self.path = Path(path)
        if not is_gguf_file(self.path):
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        self.reader = GGUFReader(str(self.path))
        self.metadata: dict[str, Any] = {}
        for name, field in self.reader.fields.items():
            if name.startswith("GGUF.") or name in _TOKENIZER_ARRAYS:
                continue
            self.metadata[name] = field.contents()
        self.tensor_names = [t.name for t in self.reader.tensors]

    def array(self, key: str) -> list[Any] | None:
        field = self.reader.fields.get(key)
        return None if field is None else list(field.contents())

    # --------------------------------------------------------------------------------------- config
    def model_config(self) -> ModelConfig:
        meta = dict(self.metadata)
        tokens = self.array("tokenizer.ggml.tokens")
        if tokens is not None and f"{meta.get('general.architecture')}.vocab_size" not in meta:
            meta["tokenizer.ggml.tokens"] = tokens
        config = ModelConfig.from_gguf_metadata(meta, self.tensor_names)
        eos = list(config.eos_token_ids)
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos:
            eos.append(int(eot))  # chat models end a turn with EOT; stop on it too
        config = config.with_eos(eos)
        if "rope_freqs.weight" in self.tensor_names:
            # llama3-style scaling: GGUF keeps the per-frequency factors as a tensor, not the parameters.
            factors = self._tensor_array("rope_freqs.weight").reshape(-1)
            config = replace(
                config,
                rope_scaling=replace(config.rope_scaling, freq_factors=tuple(float(f) for f in factors)),
            )
        return config

    # --------------------------------------------------------------------------------------- tensors
    def _tensor_array(self, name: str) -> np.ndarray:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest axis first
        return dequantize(tensor.data, int(tensor.tensor_type), shape)

    def hf_state_dict(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """Every weight dequantised to float32, named and laid out as the HF checkpoint would be."""
        state: dict[str, torch.Tensor] = {}
        for tensor in self.reader.tensors:
            if tensor.name == "rope_freqs.weight":
                continue  # folded into the config
            hf_name, stem = _hf_name(tensor.name, config.architecture)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            array = dequantize(tensor.data, int(tensor.tensor_type), shape)
            if config.architecture == "llama" and stem in ("attn_q", "attn_k"):
                heads = config.num_heads if stem == "attn_q" else config.num_kv_heads
                array = unpermute_qk(array, heads)
            elif config.architecture == "gpt2" and stem in _GPT2_CONV1D and array.ndim == 2:
                array = array.T
            state[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def q4_weights(self, config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The Q4_0/Q4_1 matrices in their own blocks, by HF name: ``(codes, scale, zero)`` (see
        :func:`~app.engine.loading.dequant.q4_groups`), rows in HF order. GPT-2's transposed Conv1D weights
        are left out: their blocks run along the wrong axis for a row-wise product."""
        return self._block_matrices(config, lambda raw, qtype, shape: q4_groups(raw, qtype, shape))

    def q8_0_weights(self, config: ModelConfig) -> dict[str, tuple[torch.Tensor, ...]]:
        """The Q8_0 matrices in their own blocks, by HF name: ``(q, scale)`` (see
        :func:`~app.engine.loading.dequant.q8_0_groups`), laid out as :meth:`q4_weights` lays out its own."""
        return self._block_matrices(config, lambda raw, qtype, shape: q8_0_groups(raw, shape), (Q8_0,))

    def _block_matrices(
        self,
        config: ModelConfig,
        split: Callable[[np.ndarray, int, tuple[int, int]], tuple[np.ndarray, ...]],
        qtypes: tuple[int, ...] = (Q4_0, Q4_1),
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tensor in self.reader.tensors:
            qtype = int(tensor.tensor_type)
            if qtype not in qtypes or len(tensor.shape) != 2:
                continue
            hf_name, stem = _hf_name(tensor.name, config.architecture)
            if config.architecture == "gpt2" and stem in _GPT2_CONV1D:
                continue
            rows, cols = (int(d) for d in reversed(tensor.shape))
            parts = split(tensor.data, qtype, (rows, cols))
            if config.architecture == "llama" and stem in ("attn_q", "attn_k"):
                heads = config.num_heads if stem == "attn_q" else config.num_kv_heads
                parts = tuple(unpermute_qk(a, heads) for a in parts)
            out[hf_name] = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in parts)
        return out

    # --------------------------------------------------------------------------------------- tokenizer
    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        return build_gguf_tokenizer(self.metadata, self.array, config)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows (head, pair, 2) back to HF's (head, 2, pair)."""
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"cannot unpermute a q/k tensor of {rows} rows into {num_heads} heads")
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str, arch: str) -> tuple[str, str]:
    """HF tensor name for a GGUF tensor name, and the GGUF stem (e.g. ``attn_q``) for layout fixes."""
    parts = gguf_name.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        raise ConfigError(f"unexpected GGUF tensor {gguf_name!r}")
    suffix = parts[-1]
    per_layer, global_names, layer_prefix = (
        (_LLAMA_NAMES, _LLAMA_GLOBAL, "model.layers")
        if arch == "llama"
        else (_GPT2_NAMES, _GPT2_GLOBAL, "transformer.h")
    )
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in per_layer:
        return f"{layer_prefix}.{parts[1]}.{per_layer[parts[2]]}.{suffix}", parts[2]
    if len(parts) == 2 and parts[0] in global_names:
        return f"{global_names[parts[0]]}.{suffix}", parts[0]
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")


def build_gguf_tokenizer(meta: Mapping[str, Any], array: Any, config: ModelConfig) -> Tokenizer:
    """A byte-level BPE ``tokenizers`` tokenizer from ``tokenizer.ggml.*`` (the gpt2 model SmolLM2 uses)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE); "
            "use the model's Hugging Face folder instead"
        )
    tokens: Sequence[str] = array("tokenizer.ggml.tokens") or []
    merges_raw: Sequence[str] = array("tokenizer.ggml.merges") or []
    types: Sequence[int] = array("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens:
        raise ConfigError("GGUF file has no tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ConfigError(f"malformed GGUF merge {m!r}")
        merges.append((left, right))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are special; user-defined ones are matched whole but kept in text.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)

    def tok(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    return Tokenizer(
        backend,
        bos_token=tok("tokenizer.ggml.bos_token_id"),
        eos_token=tok("tokenizer.ggml.eos_token_id"),
        pad_token=tok("tokenizer.ggml.padding_token_id"),
        eos_token_ids=config.eos_token_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_GPT2:
        return byte_level_regex
    if pre in _PRE_DIGITS_THEN_GPT2:
        # llama.cpp: split every digit on its own, then the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in _PRE_LLAMA3:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level_plain]
        )
    if pre in _PRE_QWEN2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level_plain]
        )
    log.warning("unknown GGUF pre-tokenizer %r: using the GPT-2 split; tokens may differ from llama.cpp", pre)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_GPT2_SPLIT), "isolated"), byte_level_plain])
