"""Model configuration: one architecture-neutral description built from an HF config.json or GGUF metadata.

The engine's models read only :class:`ModelConfig`; every source format is translated here, so a new format
needs a new constructor, not changes in the models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

Architecture = Literal["llama", "gpt2"]
RopeType = Literal["default", "linear", "llama3"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "gpt2")
# HF `architectures` / `model_type` names that map onto our two implementations.
_HF_MODEL_TYPES: dict[str, Architecture] = {"llama": "llama", "gpt2": "gpt2"}
_HF_ARCH_CLASSES: dict[str, Architecture] = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}


class ConfigError(ValueError):
    """A model configuration the engine cannot run (unknown architecture, unsupported option)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` means none; ``freq_factors`` (from GGUF ``rope_freqs``) overrides."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # Per-frequency divisors exactly as llama.cpp stores them (tensor `rope_freqs.weight`); when set they replace
    # the analytic llama3 formula, because GGUF keeps only the result, not its parameters.
    freq_factors: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, max_position_embeddings: int) -> RopeScaling:
        if not params:
            return cls()
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type == "default":
            return cls()
        if rope_type == "linear":
            return cls(rope_type="linear", factor=float(params["factor"]))
        if rope_type == "llama3":
            return cls(
                rope_type="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", max_position_embeddings)
                ),
            )
        raise ConfigError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
        )

    def to_hf(self, rope_theta: float) -> dict[str, Any]:
        """The transformers-5 ``rope_parameters`` dict (also readable as old-style ``rope_scaling``)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": rope_theta}
        if self.rope_type == "linear":
            out["factor"] = self.factor
        elif self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint, independent of its file format."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported ({SUPPORTED_ARCHITECTURES})"
            )
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, attr) <= 0:
                raise ConfigError(f"{attr} must be positive, got {getattr(self, attr)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture == "gpt2" and self.num_kv_heads != self.num_heads:
            raise ConfigError("gpt2 has no grouped-query attention: num_kv_heads must equal num_heads")

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """KV-cache bytes one token costs across all layers (K and V): the block manager's budget unit."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse RoPE frequencies [head_dim // 2], float32, computed exactly as transformers does."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        rs = self.rope_scaling
        if rs.freq_factors is not None:
            factors = torch.tensor(rs.freq_factors, dtype=torch.float32)
            if factors.numel() != inv_freq.numel():
                raise ConfigError(
                    f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}"
                )
            return inv_freq / factors
        if rs.rope_type == "linear":
            return inv_freq / rs.factor
        if rs.rope_type == "llama3":
            old_ctx = rs.original_max_position_embeddings or self.max_position_embeddings
            low_freq_wavelen = old_ctx / rs.low_freq_factor
            high_freq_wavelen = old_ctx / rs.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
            smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
            is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            return torch.where(is_medium, smoothed, scaled)
        return inv_freq

    # ------------------------------------------------------------------------------------------ from formats
    @classmethod
    def from_hf_config(
        cls, cfg: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (and optionally ``generation_config.json``)."""
        arch = _hf_architecture(cfg)
        eos = _as_id_tuple((generation_config or {}).get("eos_token_id")) or _as_id_tuple(
            cfg.get("eos_token_id")
        )
        bos = cfg.get("bos_token_id")
        pad = cfg.get("pad_token_id")
        name = str(cfg.get("_name_or_path", "") or "")
        if arch == "gpt2":
            for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
                if cfg.get(flag):
                    raise ConfigError(f"gpt2 option {flag}=True is not supported")
            if cfg.get("scale_attn_weights") is False:
                raise ConfigError("gpt2 option scale_attn_weights=False is not supported")
            hidden = int(cfg["n_embd"])
            heads = int(cfg["n_head"])
            return cls(
                architecture="gpt2",
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("n_inner") or 4 * hidden),
                num_layers=int(cfg["n_layer"]),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                max_position_embeddings=int(cfg.get("n_positions", 1024)),
                layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                attention_bias=True,
                mlp_bias=True,
                activation=_check_activation(str(cfg.get("activation_function", "gelu_new")), "gpt2"),
                bos_token_id=bos,
                eos_token_ids=eos,
                pad_token_id=pad,
                name=name,
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # transformers 5 keeps theta and scaling in `rope_parameters`; older configs use the two keys below.
        rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = RopeScaling.from_hf(rope_params, max_pos)
        if cfg.get("inf_engine_rope_freq_factors"):
            scaling = replace(
                scaling, freq_factors=tuple(float(f) for f in cfg["inf_engine_rope_freq_factors"])
            )
        return cls(
            architecture="llama",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            activation=_check_activation(str(cfg.get("hidden_act", "silu")), "llama"),
            bos_token_id=bos,
            eos_token_ids=eos,
            pad_token_id=pad,
            name=name,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tensor_names: Sequence[str] = ()) -> ModelConfig:
        """Build from GGUF key/values (already decoded to Python values) and the file's tensor names."""
        arch = str(meta.get("general.architecture", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"GGUF architecture {arch!r} is not supported ({SUPPORTED_ARCHITECTURES})")

        def key(suffix: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{suffix}", default)
            if value is None:
                raise ConfigError(f"GGUF metadata lacks {arch}.{suffix}")
            return value

        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else 0))
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
        eos = _as_id_tuple(meta.get("tokenizer.ggml.eos_token_id"))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        pad = meta.get("tokenizer.ggml.padding_token_id")
        # GGUF omits output.weight when the head is tied to the embedding.
        tied = "output.weight" not in tensor_names if tensor_names else True
        common: dict[str, Any] = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings=tied,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            pad_token_id=None if pad is None else int(pad),
            name=str(meta.get("general.name", "")),
        )
        if arch == "gpt2":
            return cls(
                architecture="gpt2",
                head_dim=hidden // heads,
                layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-5)),
                attention_bias=True,
                mlp_bias=True,
                activation="gelu_new",
                **common,
            )
        head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
        rope_dims = int(meta.get("llama.rope.dimension_count") or head_dim)
        if rope_dims != head_dim:
            raise ConfigError(
                f"partial rotary embeddings (rope dims {rope_dims} < head_dim {head_dim}) unsupported"
            )
        scaling_type = str(meta.get("llama.rope.scaling.type", "none"))
        if scaling_type in ("none", ""):
            scaling = RopeScaling()
        elif scaling_type == "linear":
            scaling = RopeScaling(rope_type="linear", factor=float(meta["llama.rope.scaling.factor"]))
        else:
            raise ConfigError(f"GGUF rope scaling {scaling_type!r} is not supported (none, linear)")
        # GGUF has no bias flags: the tensors themselves say whether biases exist.
        names = set(tensor_names)
        return cls(
            architecture="llama",
            head_dim=head_dim,
            attention_bias="blk.0.attn_q.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            activation="silu",
            **common,
        )

    # ------------------------------------------------------------------------------------------ to formats
    def to_hf_config(self) -> dict[str, Any]:
        """An HF ``config.json`` dict for this model (the converted cache is an ordinary HF folder)."""
        eos: int | list[int] | None = (
            list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id
        )
        base: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
            "_name_or_path": self.name,
        }
        if self.architecture == "gpt2":
            return {
                **base,
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_embd": self.hidden_size,
                "n_head": self.num_heads,
                "n_layer": self.num_layers,
                "n_inner": self.intermediate_size,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.layer_norm_eps,
                "activation_function": self.activation,
            }
        out = {
            **base,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_scaling.to_hf(self.rope_theta),
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": self.activation,
        }
        if self.rope_scaling.rope_type != "default":
            out["rope_scaling"] = self.rope_scaling.to_hf(self.rope_theta)
        if self.rope_scaling.freq_factors is not None:
            # Not expressible in HF terms; our loader reads this key back (transformers ignores it).
            out["inf_engine_rope_freq_factors"] = list(self.rope_scaling.freq_factors)
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_eos(self, eos_token_ids: Sequence[int]) -> ModelConfig:
        return replace(self, eos_token_ids=tuple(int(i) for i in eos_token_ids))


def _hf_architecture(cfg: Mapping[str, Any]) -> Architecture:
    model_type = str(cfg.get("model_type", ""))
    if model_type in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[model_type]
    for cls_name in cfg.get("architectures") or ():
        if cls_name in _HF_ARCH_CLASSES:
            return _HF_ARCH_CLASSES[cls_name]
    raise ConfigError(
        f"model_type {model_type!r} / architectures {cfg.get('architectures')!r} not supported "
        f"(supported: {sorted(_HF_MODEL_TYPES)})"
    )


def _check_activation(name: str, arch: str) -> str:
    allowed = {"llama": {"silu"}, "gpt2": {"gelu_new", "gelu_pytorch_tanh", "gelu"}}[arch]
    if name not in allowed:
        raise ConfigError(f"{arch} activation {name!r} is not supported ({sorted(allowed)})")
    return name


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
