"""The engine's tokenizer: a thin wrapper over a ``tokenizers.Tokenizer`` plus the model's chat template.

Loads from a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json`` / ``chat_template.jinja``) or
is built from GGUF vocabulary metadata (see ``app.engine.loading.gguf``), and saves back to the HF layout so the
converted cache holds an ordinary tokenizer folder. Needs no ``transformers`` at run time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# A UTF-8 character is at most 4 bytes: after this many undecodable tokens we emit what we have.
_MAX_PENDING_TOKENS = 4
_REPLACEMENT = "\ufffd"
# Texts (characters) and id lists longer than this go through the Rust tokenizer's batch calls, which release the
# GIL while they work (the single calls hold it: an 8 MB /tokenize froze the event loop for 15 s); short ones
# keep the single calls, which are a little faster.
_RELEASE_GIL_ABOVE = 16_384


class Tokenizer:
    """Encode/decode, special ids, and chat formatting for one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        ids = [int(i) for i in eos_token_ids]
        eos_id = self._id_of(eos_token)
        if eos_id is not None and eos_id not in ids:
            ids.insert(0, eos_id)
        # Models often stop on several ids (e.g. <|im_end|> and <|endoftext|>); the first is "the" eos.
        self._eos_token_ids: tuple[int, ...] = tuple(ids)

    # ------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, folder: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (and ``chat_template.jinja``) from a folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        backend = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None and (folder / "chat_template.json").is_file():
            template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get(
                "chat_template"
            )
        return cls(
            backend,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            eos_token_ids=eos_token_ids,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
        )

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (readable by us and by transformers)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), "utf-8")

    # ------------------------------------------------------------------------------------------ ids
    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in added.items() if tok.special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ------------------------------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS/EOS rules apply."""
        if len(text) > _RELEASE_GIL_ABOVE:
            encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = list(encoding.ids)
        if add_special_tokens:
            # tokenizer.json's post-processor usually adds BOS itself; add_bos_token covers the files where
            # only tokenizer_config.json (or GGUF metadata) says so.
            bos = self.bos_token_id
            if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            eos = self.eos_token_id
            if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        id_list = [int(i) for i in ids]
        if len(id_list) > _RELEASE_GIL_ABOVE:
            return str(self.backend.decode_batch([id_list], skip_special_tokens=skip_special_tokens)[0])
        return str(self.backend.decode(id_list, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template (as transformers renders it)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template= or use plain prompts")
        for i, m in enumerate(messages):
            if "role" not in m:
                raise ValueError(f"message {i} has no 'role'")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            **kwargs,
        }
        return _compile_template(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
        )

    def incremental_detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streaming text from token ids: each ``add`` returns only the newly stable text.

    Text is decoded over a small sliding window of ids (so tokenizers that drop a leading space on the first
    token still join words correctly), and held back while it ends in U+FFFD: a multi-byte UTF-8 character split
    across tokens decodes to the replacement char until its last byte arrives.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the first output token its left context; they are never emitted.
        self._ids: list[int] = [int(i) for i in prompt_ids[-_MAX_PENDING_TOKENS - 1 :]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_context = len(self._ids)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """Output ids seen so far (without the prompt context)."""
        return self._ids[self._num_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append new ids; return the text that became stable (possibly "")."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(int(i) for i in token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if len(full) > len(prefix) and (not full.endswith(_REPLACEMENT) or pending > _MAX_PENDING_TOKENS):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (e.g. a truly invalid byte)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON, as in transformers.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        # The settings transformers uses, so templates render the same text.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = env.from_string(source)
        _TEMPLATE_CACHE[source] = template
    return template
