"""Test helpers: tiny random HF checkpoints, a tiny tokenizer, a minimal paged-KV runner, and an HF greedy loop."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from app.engine.attention import AttentionMetadata, allocate_kv_cache
from app.engine.models.base import PagedCausalLM

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
