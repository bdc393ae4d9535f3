"""Our BERT encoder (float32, inference only), numerically matched to transformers' ``BertModel``.

Tokens travel packed: a group of sequences is one ``[total_tokens, hidden]`` matrix, so the dense layers
(nearly all the FLOPs) never multiply padding. Attention must not mix sequences: equal-length sequences sit
side by side (the caller sorts them), so each run of them is attended as an unmasked batch of views; a group
of many lengths is copied into a padded grid for one masked attention instead (see ``Layout``). q, k and v are
one fused product; on CPU every product runs on a weight packed once for oneDNN, with the GELU or the residual
add fused into it. Per layer that is 7 parallel ops where transformers runs about 12.

The products are nearly all the time and run at about MKL's FLOP rate on one thread, so the gain over
sentence-transformers (scripts/bench_embeddings.py, 2 AVX2 cores) is the padding, the fused ops and oneDNN's
better 2-thread products: 1.2x on one thread; 1.2-1.5x on two, more when other processes load the machine,
where every parallel op's thread barrier costs and ours has fewer of them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from app.engine.kernels.cpu_features import onednn_linear_op

SUPPORTED_MODEL_TYPES = ("bert",)
# HF's activation names -> oneDNN's GELU algorithm ("none": the exact erf GELU, HF's "gelu"; "tanh": approximate)
_GELUS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
# oneDNN packs a weight for a typical row count; the packed weight serves any row count
_PACK_ROWS_HINT = 256
# up to this many different lengths in a group, attention runs once per length (see Layout)
MAX_RUNS = 4
# torch's oneDNN linear where this build and CPU run it, else None (then F.linear)
_ONEDNN = onednn_linear_op()


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> BertConfig:
        """The sizes of a BERT ``config.json``; ValueError (one line) for anything our encoder would get wrong."""
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type {model_type!r} is not supported by our encoder (only "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        position = data.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"{source}: position_embedding_type {position!r} is not supported (only 'absolute')")
        act = str(data.get("hidden_act", "gelu"))
        if act not in _GELUS:
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (one of {', '.join(_GELUS)})")
        try:
            config = cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=int(data["num_attention_heads"]),
                intermediate_size=int(data["intermediate_size"]),
                hidden_act=act,
                layer_norm_eps=float(data.get("layer_norm_eps", 1e-12)),
                max_position_embeddings=int(data.get("max_position_embeddings", 512)),
                type_vocab_size=int(data.get("type_vocab_size", 2)),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing {exc.args[0]!r}") from None
        if config.hidden_size % config.num_heads:
            raise ValueError(f"{source}: hidden_size {config.hidden_size} is not a multiple of "
                             f"num_attention_heads {config.num_heads}")
        return config


class Dense(nn.Module):
    """``x @ W.T + b``, then GELU or ``+ residual`` when asked, all in one oneDNN product on a CPU weight
    packed once (fewer passes over the activations, fewer thread barriers), else ``F.linear`` and torch ops."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, gelu: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
        self.gelu = gelu  # None, or oneDNN's algorithm name: "none" (exact erf) or "tanh"
        self.packed: torch.Tensor | None = None
        self.bf16_bias: torch.Tensor | None = None  # set when the product runs in bfloat16

    def pack(self, bf16: bool = False) -> None:
        """Pack the weight into oneDNN's blocked layout (CPU), once, rather than in every product; ``bf16``: a
        bfloat16 copy, for products of bfloat16 inputs summed in float32 (twice float32's rate on AVX512-BF16)."""
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        if _ONEDNN is None or reorder is None or self.weight.device.type != "cpu":
            return
        with torch.inference_mode(False), torch.no_grad():
            weight = self.weight.detach()
            self.packed = reorder(weight.bfloat16() if bf16 else weight, _PACK_ROWS_HINT)
            self.bf16_bias = self.bias.detach().bfloat16() if bf16 else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.bf16_bias is not None and self.packed is not None:
            return self._bf16(x, residual)
        if self.packed is not None and x.device.type == "cpu":
            if residual is not None:
                return _ONEDNN.binary(x, residual, self.packed, self.bias, "add")
            if self.gelu is not None:
                return _ONEDNN(x, self.packed, self.bias, "gelu", [], self.gelu)
            return _ONEDNN(x, self.packed, self.bias, "none", [], "")
        out = F.linear(x, self.weight, self.bias)
        if residual is not None:
            return out.add_(residual)
        return out if self.gelu is None else F.gelu(out, approximate="none" if self.gelu == "none" else "tanh")

    def _bf16(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The bfloat16 product: its input rounded to bfloat16, the GELU's output left in bfloat16 (the next
        product's input), everything else back in float32: the residual stream, the norms and attention stay
        float32, where bfloat16's rounding would accumulate."""
        assert _ONEDNN is not None and self.packed is not None
        xb = x if x.dtype == torch.bfloat16 else x.bfloat16()
        if self.gelu is not None and residual is None:
            return _ONEDNN(xb, self.packed, self.bf16_bias, "gelu", [], self.gelu)
        out = _ONEDNN(xb, self.packed, self.bf16_bias, "none", [], "").float()
        return out if residual is None else out.add_(residual)


class Layout:
    """Where a group's packed sequences are for attention, which must not mix sequences (shared by the layers).

    Runs: sequences of equal length sit next to each other (``EmbeddingModel`` sorts them), so each run of them
    is already a ``[count, len]`` batch: attention runs once per run, unmasked, on views of the packed rows.
    With more than ``MAX_RUNS`` different lengths, the rows are copied into the padded ``[batch, longest]`` grid
    for one masked attention, and back.
    """

    def __init__(self, lengths: list[int], num_heads: int, device: torch.device) -> None:
        self.batch, self.width = len(lengths), max(lengths)
        self.num_heads = num_heads
        self.runs: list[tuple[int, int, int]] | None = []  # (first row, sequences, length)
        row = 0
        for length, same in itertools.groupby(lengths):
            count = len(list(same))
            self.runs.append((row, count, length))
            row += count * length
        self.slots: torch.Tensor | None = None  # real tokens' rows in the flattened grid
        self.mask: torch.Tensor | None = None  # [batch, 1, 1, longest], True: a real key
        if len(self.runs) > MAX_RUNS:
            self.runs = None
            lens = torch.tensor(lengths, device=device)
            grid = torch.arange(self.width, device=device).expand(self.batch, -1) < lens[:, None]
            self.slots = grid.flatten().nonzero().flatten()
            self.mask = grid[:, None, None, :]

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[tokens, 3*hidden]`` (q | k | v) -> the attention context ``[tokens, hidden]``."""
        hidden = qkv.shape[1] // 3
        if self.runs is None:
            assert self.slots is not None
            grid = qkv.new_zeros(self.batch * self.width, 3 * hidden).index_copy_(0, self.slots, qkv)
            return self._attention(grid, self.batch, self.width, self.mask).index_select(0, self.slots)
        if len(self.runs) == 1:
            return self._attention(qkv, self.batch, self.width, None)
        out = qkv.new_empty(qkv.shape[0], hidden)
        for row, count, length in self.runs:
            rows = count * length
            out[row:row + rows] = self._attention(qkv[row:row + rows], count, length, None)
        return out

    def _attention(self, qkv: torch.Tensor, batch: int, width: int, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = qkv.view(batch, width, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [batch, heads, width, dim]
        return out.transpose(1, 2).reshape(batch * width, -1)


class BertLayer(nn.Module):
    """Post-LN: ``x = LN(x + attn(x)); x = LN(x + down(gelu(up(x))))``; the residual adds fused into the
    products before them."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        w = weights
        qkv = ("query", "key", "value")  # one product instead of three
        self.qkv = Dense(torch.cat([w[f"attention.self.{n}.weight"] for n in qkv]),
                         torch.cat([w[f"attention.self.{n}.bias"] for n in qkv]))
        self.attn_out = Dense(w["attention.output.dense.weight"], w["attention.output.dense.bias"])
        self.up = Dense(w["intermediate.dense.weight"], w["intermediate.dense.bias"], _GELUS[config.hidden_act])
        self.down = Dense(w["output.dense.weight"], w["output.dense.bias"])
        self.norm1 = _layer_norm(config, w, "attention.output.LayerNorm")
        self.norm2 = _layer_norm(config, w, "output.LayerNorm")

    def forward(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        x = self.norm1(self.attn_out(layout.attend(self.qkv(x)), residual=x))
        return self.norm2(self.down(self.up(x), residual=x))


class BertEncoder(nn.Module):
    """Token ids of packed sequences -> their last hidden states, ``[total_tokens, hidden]``; ``bf16``: the
    products in bfloat16 (see :meth:`Dense._bf16`), the rest in float32."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor], bf16: bool = False) -> None:
        super().__init__()
        self.bf16 = bf16
        self.config = config
        self.word = nn.Parameter(weights["embeddings.word_embeddings.weight"], requires_grad=False)
        # token type 0 for every token (single sentences), folded into the position table once
        position = weights["embeddings.position_embeddings.weight"]
        self.position = nn.Parameter(position + weights["embeddings.token_type_embeddings.weight"][0],
                                     requires_grad=False)
        self.norm = _layer_norm(config, weights, "embeddings.LayerNorm")
        self.layers = nn.ModuleList(
            BertLayer(config, {k.removeprefix(f"encoder.layer.{i}."): v for k, v in weights.items()
                               if k.startswith(f"encoder.layer.{i}.")})
            for i in range(config.num_layers)
        )
        for module in self.modules():
            if isinstance(module, Dense):
                module.pack(bf16)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """``ids`` and ``positions``: ``[total_tokens]``, the sequences one after another, of ``lengths``."""
        layout = Layout(lengths, self.config.num_heads, ids.device)
        x = self.norm(F.embedding(ids, self.word).add_(F.embedding(positions, self.position)))
        for layer in self.layers:
            x = layer(x, layout)
        return x

    @classmethod
    def from_folder(cls, folder: Path, config: BertConfig, bf16: bool = False) -> BertEncoder:
        """Read ``model.safetensors`` (names with or without a ``bert.`` prefix, old ``gamma``/``beta`` names)."""
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} has no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for path in files:
            weights.update(load_file(str(path), device="cpu"))
        try:
            return cls(config, _rename(weights, folder), bf16)
        except KeyError as exc:
            raise ValueError(f"{folder}: the weights lack {exc.args[0]!r} (of config.json's "
                             f"{config.num_layers} layers)") from None


def _rename(weights: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Checkpoint names -> ``BertModel``'s (no ``bert.`` prefix, ``weight``/``bias`` for LayerNorms), float32."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        name = name.removeprefix("bert.")
        if name.endswith(".gamma") or name.endswith(".beta"):
            name = name.rpartition(".")[0] + (".weight" if name.endswith(".gamma") else ".bias")
        out[name] = tensor.float() if tensor.is_floating_point() else tensor
    missing = [n for n in ("embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                           "embeddings.token_type_embeddings.weight", "encoder.layer.0.output.dense.weight")
               if n not in out]
    if missing:
        raise ValueError(f"{folder}: the weights are not a BERT encoder's (missing {', '.join(missing)})")
    return out


class _LayerNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def _layer_norm(config: BertConfig, weights: dict[str, torch.Tensor], name: str) -> _LayerNorm:
    return _LayerNorm(weights[f"{name}.weight"], weights[f"{name}.bias"], config.layer_norm_eps)
