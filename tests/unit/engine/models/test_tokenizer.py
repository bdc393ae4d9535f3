"""The Tokenizer wrapper and the HF-folder loader's tokenizer / config handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.engine.loading import load_model
from app.engine.tokenizer import Tokenizer
from tests.support.engine_models import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder, 300)
    return folder


def test_encode_decode_and_specials(tok_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tok_dir)
    assert tok.vocab_size == 300
    assert tok.bos_token == "<|im_start|>" and tok.eos_token_id == tok.token_to_id("<|im_end|>")
    text = "the lazy dog says héllo 你好"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    with_special = tok.encode("<|im_start|>hi<|im_end|>")
    assert with_special[0] == tok.bos_token_id and with_special[-1] == tok.eos_token_id
    assert tok.decode(with_special) == "hi"
    assert tok.eos_token_id in tok.all_special_ids


def test_add_bos_token_from_config(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tok_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("the")[0] == tok.bos_token_id
    assert tok.encode("the", add_special_tokens=False)[0] != tok.bos_token_id


def test_chat_template_sources(tok_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    # transformers 5 saves the template as chat_template.jinja beside the config
    shutil.copytree(tok_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}{{ eos_token }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(msgs) == "HI<|im_end|>"
    # templates may raise; tojson emits plain JSON
    raising = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        tok.apply_chat_template(msgs, chat_template=raising)
    assert (
        tok.apply_chat_template(msgs, chat_template="{{ messages | tojson }}")
        == '[{"role": "user", "content": "hi"}]'
    )


def test_no_chat_template_is_a_clear_error(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tok_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenizer_multibyte(tok_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tok_dir)
    text = "héllo 你好 wörld 🙂!"
    ids = tok.encode(text)
    detok = tok.incremental_detokenizer()
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert detok.token_ids == ids
    # several ids at once, and prompt context is never emitted
    d2 = tok.incremental_detokenizer(prompt_ids=tok.encode("the quick"))
    assert d2.add(tok.encode(" fox")) + d2.flush() == " fox"


def test_invalid_bytes_are_flushed_at_the_end(tok_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tok_dir)
    lead_byte = tok.token_to_id("ä")  # byte-level symbol of 0xE4: a 3-byte UTF-8 lead byte alone
    assert lead_byte is not None
    detok = tok.incremental_detokenizer()
    assert detok.add(lead_byte) == ""
    assert detok.flush() == "\ufffd"


def test_hf_folder_loading_errors(tmp_path: Path, tiny_models: dict[str, tuple[Path, Any]]) -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)
    folder = tmp_path / "copy"
    shutil.copytree(tiny_models["gpt2"][0], folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_model(folder)
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="neither"):
        load_model(bogus)


def test_sharded_checkpoint_and_generation_config(
    tiny_models: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    folder = tiny_models["llama_mqa_tied_linear"][0]
    assert (folder / "model.safetensors.index.json").is_file()  # saved sharded
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    _, tok, cfg = load_model(tmp_path)
    assert cfg.eos_token_ids == (2, 5)
    assert set(tok.eos_token_ids) >= {2, 5}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / next(iter(index["weight_map"].values()))).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(tmp_path)
