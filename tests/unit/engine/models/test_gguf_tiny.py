"""The GGUF path end to end on tiny models written the way llama.cpp's converter writes them.

Weights are quantised (Q8_0 / Q4_1 / F16 / F32 by tensor), q/k rows permuted (Llama), Conv1D weights transposed
(GPT-2), and the HF reference model is given the same round-tripped values, so our GGUF load must reproduce its
logits. Also covers the GGUF tokenizer and the converted cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.engine.loading import cache, load_model
from app.engine.tokenizer import Tokenizer
from tests.unit.engine.models.conftest import VOCAB, build_hf_model
from tests.unit.engine.models.helpers import PagedRunner, write_tiny_tokenizer

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as ref_dequantize  # noqa: E402
from gguf.quants import quantize  # noqa: E402

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


@pytest.fixture(scope="module", params=["llama_gqa_llama3", "llama_mqa_tied_linear", "gpt2"])
def tiny_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, Path]:
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf = build_hf_model(request.param)
    write_tiny_tokenizer(root, VOCAB)
    path = root / f"{request.param}.gguf"
    write_gguf(hf, root / "tokenizer.json", path)
    return path, hf, root


def test_gguf_logits_match_transformers(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    path, hf, _ = tiny_gguf
    model, _, config = load_model(path, cache_dir=tmp_path)
    prompt = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = PagedRunner(model, block_size=8)
    ours = runner.step([(0, prompt)])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1:]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)


def test_gguf_tokenizer_matches_tokenizer_json(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    path, _, root = tiny_gguf
    _, tok, _ = load_model(path, cache_dir=tmp_path)
    original = Tokenizer.from_pretrained(root)
    texts = [
        "the quick brown fox",
        "héllo wörld 你好!",
        "<|im_start|>user\nhi<|im_end|>",
        "  spaces  x<extra_3>",
    ]
    for text in texts:
        assert tok.encode(text) == original.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_id == original.token_to_id("<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_converted_cache_is_reused_and_invalidated(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    path, _, _ = tiny_gguf
    m1, _, _ = load_model(path, cache_dir=tmp_path)
    entry = cache.lookup(path, tmp_path)
    assert entry is not None and (entry / "model.safetensors").is_file()
    m2, tok2, _ = load_model(path, cache_dir=tmp_path)  # from the cache
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert tok2.eos_token_id is not None
    # A changed file (new mtime) misses the old entry.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache.lookup(path, tmp_path) is None
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.lookup(path, tmp_path) == entry


def test_gguf_decode_matches_prefill(tiny_gguf: tuple[Path, Any, Path], tmp_path: Path) -> None:
    """Decoding token by token over the GGUF-loaded weights equals one prefill of the whole sequence."""
    path, _, _ = tiny_gguf
    model, _, _ = load_model(path, cache_dir=tmp_path)
    seq = list(range(5, 25))
    runner = PagedRunner(model, block_size=4)
    runner.step([(0, seq[:3])])
    for t in seq[3:-1]:
        runner.step([(0, [t])])
    last = runner.step([(0, [seq[-1]])])
    meta_ref = PagedRunner(model, block_size=4).step([(0, seq)])
    torch.testing.assert_close(last, meta_ref, atol=1e-5, rtol=0)
