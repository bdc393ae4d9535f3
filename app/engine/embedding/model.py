"""``EmbeddingModel``: texts -> token ids -> sentence embeddings, for ``POST /v1/embeddings``.

Tokenising (``tokenize``) and embedding (``embed``) are separate steps so a caller can count and check tokens
(usage, limits) before spending compute, and can embed token ids it was sent. ``embed`` batches internally:
inputs sorted by length, groups of similar length packed into one forward, results back in input order.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.normalizers import Lowercase
from tokenizers.normalizers import Sequence as NormalizerSequence

from app.engine.embedding.bert import BertConfig, BertEncoder
from app.engine.embedding.folder import (
    PACKAGED_EMBEDDING_MODEL,
    FolderLayout,
    read_json,
    read_layout,
    resolve_embedding_model,
)
from app.engine.embedding.pooling import normalize, pool
from app.engine.kernels.cpu_features import bf16_products_supported

# One forward holds at most this many sequences and this many padded tokens (batch x longest): enough rows for
# efficient products (a few hundred are enough), while the activations stay small (8192 tokens x MiniLM's 1536
# intermediate floats: 50 MB) and a long input does not make a whole batch of short ones wait.
MAX_BATCH_SEQUENCES = 64
#: the encoder's product dtypes (EmbeddingModel.load's ``dtype``)
EMBEDDING_DTYPES = ("float32", "bfloat16")
MAX_BATCH_TOKENS = 8192


class EmbeddingModel:
    """A sentence-transformers style encoder: our BERT, then pooling and normalisation as its folder says."""

    def __init__(self, name: str, folder: Path, config: BertConfig, layout: FolderLayout,
                 encoder: BertEncoder, tokenizer: Tokenizer, matryoshka: bool) -> None:
        self.name = name
        self.folder = folder
        self.config = config
        self.dimensions = config.hidden_size
        # sentence-transformers caps max_seq_length at the position table, as we must
        limit = layout.max_seq_length or config.max_position_embeddings
        self.max_input_tokens = min(limit, config.max_position_embeddings)
        self.matryoshka = matryoshka
        self.pooling = layout.pooling
        self.normalize = layout.normalize
        self.encoder = encoder
        self.max_batch_sequences = MAX_BATCH_SEQUENCES  # per forward; a caller may change both
        self.max_batch_tokens = MAX_BATCH_TOKENS
        self._tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_input_tokens, strategy="longest_first")
        if layout.do_lower_case:
            tokenizer.normalizer = NormalizerSequence(
                [Lowercase()] + ([tokenizer.normalizer] if tokenizer.normalizer is not None else []))

    @classmethod
    def load(cls, name_or_path: str, *, num_threads: int | None = None, dtype: str = "float32") -> EmbeddingModel:
        """``'all-MiniLM-L6-v2'`` (the packaged model) or a local folder; ``num_threads``: torch's intra-op
        threads for this process (``torch.set_num_threads``), left alone when None; ``dtype``: ``float32`` (equal
        to sentence-transformers), or ``bfloat16`` products on CPUs with AVX512-BF16 or AMX (about twice the
        products' rate; the vectors stay within a cosine of about 1e-4 of float32's)."""
        if dtype not in EMBEDDING_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(EMBEDDING_DTYPES)}, not {dtype!r}")
        if dtype == "bfloat16" and not bf16_products_supported():
            raise ValueError("dtype='bfloat16' needs a CPU with AVX512-BF16 or AMX (this one has neither; without "
                             "them bfloat16 products are slower than float32): use float32")
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be at least 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        folder = resolve_embedding_model(name_or_path)
        raw = read_json(folder / "config.json")
        if not isinstance(raw, dict):
            raise ValueError(f"{folder / 'config.json'} must hold a JSON object")
        config = BertConfig.from_dict(raw, str(folder / "config.json"))
        layout = read_layout(folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (the fast tokenizer's file is needed)")
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        with torch.inference_mode():
            encoder = BertEncoder.from_folder(folder, config, bf16=dtype == "bfloat16").eval()
        name = PACKAGED_EMBEDDING_MODEL if name_or_path == PACKAGED_EMBEDDING_MODEL else folder.name
        matryoshka = bool(raw.get("matryoshka_dimensions") or raw.get("is_matryoshka"))
        return cls(name, folder, config, layout, encoder, tokenizer, matryoshka)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text with the model's special tokens (``[CLS] ... [SEP]``), truncated to
        ``max_input_tokens`` (special tokens included) as sentence-transformers does."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=True)]

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """float32 ``[len(inputs), dimensions]``: each list of ids used as given (no special tokens added),
        pooled and normalised as the folder says. ValueError for an empty list of ids, one longer than
        ``max_input_tokens`` or an id outside the vocabulary."""
        self._check(inputs)
        if not inputs:
            return torch.empty(0, self.dimensions, dtype=torch.float32)
        groups = self._groups(inputs)
        with torch.inference_mode():
            vectors = torch.cat([self._forward([inputs[i] for i in group]) for group in groups])
            # rows are in group order: put each back at its input's place in one scatter
            order = torch.tensor([i for group in groups for i in group])
            out = torch.empty_like(vectors).index_copy_(0, order, vectors)
        return out.clone()  # a normal tensor, usable outside inference mode

    def _check(self, inputs: list[list[int]]) -> None:
        for i, ids in enumerate(inputs):
            if not ids:
                raise ValueError(f"input {i} has no tokens: every input needs at least one token")
            if len(ids) > self.max_input_tokens:
                raise ValueError(f"input {i} has {len(ids)} tokens, more than this model's limit of "
                                 f"{self.max_input_tokens} ({self.name})")
            if min(ids) < 0 or max(ids) >= self.config.vocab_size:
                bad = next(t for t in ids if not 0 <= t < self.config.vocab_size)
                raise ValueError(f"input {i} has token id {bad}, outside this model's vocabulary "
                                 f"(0..{self.config.vocab_size - 1})")

    def _groups(self, inputs: list[list[int]]) -> list[list[int]]:
        """Input indices in groups of similar length, longest first: each group one forward, its padded size
        (count x longest) within ``max_batch_tokens`` and its count within ``max_batch_sequences``."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]), reverse=True)
        groups: list[list[int]] = []
        group: list[int] = []
        for i in order:
            width = len(inputs[group[0]]) if group else len(inputs[i])
            if group and (len(group) >= self.max_batch_sequences or (len(group) + 1) * width > self.max_batch_tokens):
                groups.append(group)
                group = []
            group.append(i)
        if group:
            groups.append(group)
        return groups

    def _forward(self, sequences: list[list[int]]) -> torch.Tensor:
        """One packed forward of ``sequences`` -> their pooled (and normalised) vectors."""
        lengths = [len(ids) for ids in sequences]
        ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
        lens = torch.tensor(lengths)
        starts = lens.cumsum(0) - lens
        positions = torch.arange(ids.shape[0]) - starts.repeat_interleave(lens)  # 0.. within each sequence
        states = self.encoder(ids, positions, lengths)
        vectors = pool(states, lens, self.pooling)
        return normalize(vectors) if self.normalize else vectors
