"""The engine tests' tiny models: random-weight HF checkpoints (Llama and GPT-2), their byte-level BPE tokenizer, a
minimal paged-KV runner, and transformers' greedy loop to compare with."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from app.engine.attention import AttentionMetadata, allocate_kv_cache
from app.engine.models.base import PagedCausalLM

VOCAB = 320
EOS = 2  # <|im_end|>: the tiny tokenizer's and the tiny models' end of sequence

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads over 2 kv heads), separate lm_head, llama3 RoPE scaling that bites at short range.
    "llama_gqa_llama3": dict(
        kind="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Multi-query (one kv head), tied embeddings, linear RoPE scaling, attention biases, sharded safetensors.
    "llama_mqa_tied_linear": dict(
        kind="llama",
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        shard="60KB",
    ),
    "gpt2": dict(kind="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256),
}
TINY_NAMES = tuple(TINY_CONFIGS)  # llama (GQA, llama3 RoPE), llama (MQA, tied, linear RoPE), gpt2


def build_hf_model(name: str) -> Any:
    """The transformers model of ``TINY_CONFIGS[name]``, with seeded random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    spec = dict(TINY_CONFIGS[name])
    kind = spec.pop("kind")
    spec.pop("shard", None)
    torch.manual_seed(1234)
    # A larger init than the default 0.02 makes logits peaked, so greedy choices are not near-ties.
    model: Any
    if kind == "gpt2":
        gpt2 = GPT2Config(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=1, eos_token_id=2, **spec)
        model = GPT2LMHeadModel(gpt2)
    else:
        llama = LlamaConfig(
            vocab_size=VOCAB,
            max_position_embeddings=512,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            **spec,
        )
        model = LlamaForCausalLM(llama)
    return model.eval()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, trained on a fixed text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog, héllo wörld 你好 " * 3] * 50
    tok.train_from_iterator(corpus, trainer)
    # Pad to exactly vocab_size with ordinary added tokens (GGUF needs one token per embedding row).
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def save_hf_model(model: Any, folder: Path, max_shard_size: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **kwargs)
    write_tiny_tokenizer(folder, model.config.vocab_size)
    return folder


class PagedRunner:
    """A minimal model runner: block allocation, flat batches of prefill chunks and decodes, greedy decoding.

    Blocks are handed out in a shuffled order so sequences are never physically contiguous in the cache.
    """

    def __init__(
        self, model: PagedCausalLM, block_size: int = 4, num_blocks: int = 512, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.caches = allocate_kv_cache(model.config, num_blocks, block_size)
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        self.free = free
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _reserve(self, sid: int, length: int) -> None:
        table = self.tables.setdefault(sid, [])
        while len(table) * self.block_size < length:
            table.append(self.free.pop())

    def share_prefix(self, src: int, dst: int, num_blocks: int) -> int:
        """Prefix caching: ``dst`` starts with ``src``'s first full blocks (no recompute); returns tokens shared."""
        self.tables[dst] = list(self.tables[src][:num_blocks])
        self.lens[dst] = num_blocks * self.block_size
        return self.lens[dst]

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one flat batch (``(seq_id, new_tokens)`` per sequence); logits of each chunk's last token."""
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            self._reserve(sid, start + len(toks))
            ids += toks
            pos += list(range(start, start + len(toks)))
            qlens.append(len(toks))
            ctxs.append(start + len(toks))
            self.lens[sid] = start + len(toks)
        meta = AttentionMetadata.build(qlens, ctxs, [self.tables[s] for s, _ in chunks], self.block_size)
        self.model.bind_kv_cache(self.caches)  # several runners may share one model
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta)
        return self.model.compute_logits(hidden[meta.cu_seqlens_q[1:] - 1])

    def greedy(
        self, prompts: list[list[int]], max_new: int, first_id: int = 0
    ) -> tuple[list[list[int]], torch.Tensor]:
        """All prompts prefilled in one batch, then decoded together; returns tokens and the last logits."""
        sids = list(range(first_id, first_id + len(prompts)))
        logits = self.step(list(zip(sids, prompts, strict=True)))
        out: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new):
            nxt = logits.argmax(-1).tolist()
            for o, t in zip(out, nxt, strict=True):
                o.append(t)
            if step + 1 < max_new:
                logits = self.step([(s, [t]) for s, t in zip(sids, nxt, strict=True)])
        return out, logits


def hf_greedy(hf_model: Any, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers ``generate(do_sample=False)`` with EOS disabled; returns new tokens and the last step's logits."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[-1][0]
