"""Tiny models written as GGUF files the way llama.cpp's converter writes them (``gguf`` must be installed:
test modules import this after ``pytest.importorskip("gguf")``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize

from tests.support.engine_models import VOCAB, build_hf_model, write_tiny_tokenizer

Q4_MODEL = "llama_gqa_llama3"  # hidden 64, intermediate 128: every projection is whole 32-blocks

LLAMA_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GPT2_LAYER = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}


def _gguf_name(hf_name: str, arch: str) -> str | None:
    if arch == "llama":
        glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
        layer_map, prefix = LLAMA_LAYER, "model.layers."
    else:
        glob = {
            "transformer.wte": "token_embd",
            "transformer.wpe": "position_embd",
            "transformer.ln_f": "output_norm",
        }
        layer_map, prefix = GPT2_LAYER, "transformer.h."
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in glob:
        return f"{glob[stem]}.{suffix}"
    if stem.startswith(prefix):
        idx, rest = stem[len(prefix) :].split(".", 1)
        return f"blk.{idx}.{layer_map[rest]}.{suffix}"
    return None


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (interleaved rotary pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf: Any, tokenizer_json: Path, path: Path, kinds: list[Any] | None = None) -> None:
    """Write ``hf`` as llama.cpp would; updates ``hf``'s weights in place to the quantised values. Matrices
    take the formats ``kinds`` in turn (default: Q8_0, Q4_1, F16)."""
    cfg = hf.config
    arch = "llama" if cfg.model_type == "llama" else "gpt2"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    if arch == "llama":
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        rope = cfg.rope_parameters
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        elif rope.get("rope_type") == "llama3":
            # llama.cpp keeps llama3 scaling only as per-frequency factors (tensor rope_freqs).
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
            dim = cfg.hidden_size // cfg.num_attention_heads
            base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
            writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    else:
        writer.add_feed_forward_length(4 * cfg.hidden_size)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)

    tok = json.loads(tokenizer_json.read_text())
    vocab = dict(tok["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg.vocab_size
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    added = {t["content"] for t in tok["added_tokens"] if not t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 4 if t in added else 1 for t in tokens])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")

    kinds = kinds or [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F16]
    with torch.no_grad():
        for i, (name, param) in enumerate(hf.state_dict().items()):
            gname = _gguf_name(name, arch)
            if gname is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            w = param.numpy().astype(np.float32)
            is_conv1d = arch == "gpt2" and gname.split(".")[-2] in (
                "attn_qkv",
                "attn_output",
                "ffn_up",
                "ffn_down",
            )
            if is_conv1d and w.ndim == 2:
                w = w.T.copy()
            qtype = gguf.GGMLQuantizationType.F32
            if w.ndim == 2:
                qtype = kinds[i % len(kinds)] if w.shape[1] % 32 == 0 else gguf.GGMLQuantizationType.F16
            packed = quantize(w, qtype)
            rounded = ref_dequantize(packed, qtype).reshape(w.shape)
            param.copy_(torch.from_numpy(rounded.T.copy() if is_conv1d and w.ndim == 2 else rounded))
            if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
                packed = quantize(_permute(rounded, heads), qtype)
            writer.add_tensor(gname, packed, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_q4(root: Path, qtype: Any) -> Path:
    """``Q4_MODEL`` written to ``root`` as a GGUF file whose matrices are all in ``qtype`` blocks, with its
    tokenizer beside it."""
    hf = build_hf_model(Q4_MODEL)
    write_tiny_tokenizer(root, VOCAB)
    path = root / f"tiny-{qtype.name}.gguf"
    write_gguf(hf, root / "tokenizer.json", path, kinds=[qtype])
    return path
