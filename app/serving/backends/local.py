"""Shared by the in-process backends (native, transformers): model paths, prompt preparation, stop strings."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from app.serving.backends.base import Backend, GenerationRequest, InvalidRequestError
from app.serving.tool_prompt import messages_for_template, template_supports_tools

__all__ = [
    "LocalBackend",
    "StopStringMatcher",
    "TextCodec",
    "default_served_name",
    "load_chat_template",
    "resolve_hf_folder",
]

_DECODE_IN_THREAD_ABOVE = 4096  # token ids: a /detokenize this long is decoded in a worker thread


class TextCodec(Protocol):
    """What a local backend needs from a tokenizer (ours and transformers' both fit)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def default_served_name(model: str | None, served_model_name: str | None = None) -> str:
    """The model id clients use: the configured name, else the folder/file stem, else SmolLM2's name."""
    if served_model_name:
        return served_model_name
    if model:
        path = Path(model)
        return path.stem if path.suffix == ".gguf" else path.name
    from app.engine.loading import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def load_chat_template(value: str) -> str:
    """The Jinja source ``--chat-template`` names, as vLLM reads it: a file's text, or the value itself when it is
    a template. Raises ValueError (one line, saying what to give) for a missing file or a template that does not
    parse, so that a server never starts with a chat template it would fail on at the first request."""
    import jinja2

    text = value
    if "{{" not in value and "{%" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template: give the path of a "
                             ".jinja file, or the template itself")
        text = path.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value!r} does not parse: {exc.message} (line {exc.lineno})") from None
    return text


def resolve_hf_folder(model: str | None) -> Path:
    """An ordinary Hugging Face folder for ``model``: itself, or the converted cache of a GGUF file
    (the default SmolLM2 when ``None``), converting it once if needed."""
    if model is not None and Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    from app.engine.loading import cache, default_model_path, read_checkpoint  # torch: only when converting

    source = default_model_path() if model is None else Path(model).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"model {source} does not exist (models are never downloaded)")
    root = cache.default_cache_root()
    hit = cache.lookup(source, root)
    if hit is None:
        read_checkpoint(source, cache_dir=root)  # converts and stores the cache entry
        hit = cache.lookup(source, root)
    if hit is None:
        raise RuntimeError(f"could not convert {source} into an HF folder under {root}; is it writable?")
    return hit.resolve()


class LocalBackend(Backend):
    """A backend with a tokenizer in this process: tokenizes, renders chat templates, checks lengths."""

    codec: Any = None  # a TextCodec with apply_chat_template; set by start()
    vocab_size: int | None = None
    chat_template: str | None = None  # the server's --chat-template (its Jinja source), over the model's own

    def _require_codec(self) -> Any:
        if self.codec is None:
            from app.serving.backends.base import BackendUnavailableError

            raise BackendUnavailableError(f"the {self.name} backend is not started yet")
        return self.codec

    def template_source(self) -> str | None:
        """The chat template's Jinja source (ours: ``codec.chat_template``; transformers': its tokenizer's)."""
        codec = self._require_codec()
        source = self.chat_template or getattr(codec, "chat_template", None) or getattr(
            getattr(codec, "tokenizer", None), "chat_template", None
        )
        return source if isinstance(source, str) else None

    def _render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kw: Any,
    ) -> str:
        codec = self._require_codec()
        rendered, extra = messages_for_template(messages, tools, template_supports_tools(self.template_source()))
        if self.chat_template is not None:
            extra = {**extra, "chat_template": self.chat_template}
        try:
            text = codec.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, **{**kw, **extra}
            )
        except Exception as exc:  # template errors (jinja raise_exception, missing roles) are the caller's
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
        return str(text)

    def _encode(
        self,
        *,
        prompt: str | list[int] | None,
        messages: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        codec = self._require_codec()
        if messages is not None:
            text = self._render_chat(messages, add_generation_prompt, tools, **dict(chat_template_kwargs or {}))
            return list(codec.encode(text, add_special_tokens=False))  # the template holds BOS itself
        if isinstance(prompt, str):
            return list(codec.encode(prompt, add_special_tokens=add_special_tokens))
        ids = list(prompt or [])
        vocab = self.vocab_size
        for token_id in ids:
            if not isinstance(token_id, int) or token_id < 0 or (vocab is not None and token_id >= vocab):
                limit = f" below {vocab}" if vocab is not None else ""
                raise InvalidRequestError(
                    f"prompt token id {token_id!r} is out of range: ids must be integers from 0{limit}",
                    param="prompt",
                )
        return ids

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Prompt token ids of ``request``, checked against the context length and the vocabulary."""
        param = "messages" if request.is_chat else "prompt"
        ids = self._encode(
            prompt=request.prompt,
            messages=request.messages,
            add_special_tokens=True,
            add_generation_prompt=request.add_generation_prompt,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
        )
        if not ids:
            raise InvalidRequestError(
                f"the {param} is empty: it must contain at least one token", param=param
            )
        limit = self.max_model_len
        max_tokens = request.params.max_tokens
        if limit is not None:
            if len(ids) >= limit:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, your {param} has "
                    f"{len(ids)} tokens. Please reduce the length of the {param}.",
                    param=param,
                    code="context_length_exceeded",
                )
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the {param}, {max_tokens} in the "
                    "completion). Please reduce the length of the prompt or of max_tokens.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        vocab = self.vocab_size
        if vocab is not None:
            for token_id in request.params.logit_bias or {}:
                if token_id >= vocab:
                    raise InvalidRequestError(
                        f"logit_bias names token id {token_id}, but the vocabulary has {vocab} tokens",
                        param="logit_bias",
                    )
            for token_id in request.params.stop_token_ids or ():
                if token_id >= vocab:
                    raise InvalidRequestError(
                        f"stop_token_ids names token id {token_id}, but the vocabulary has {vocab} tokens",
                        param="stop_token_ids",
                    )
        return ids

    async def tokenize(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return await asyncio.to_thread(
            self._encode,
            prompt=prompt,
            messages=messages,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        codec = self._require_codec()
        vocab = self.vocab_size
        for token_id in token_ids:
            if token_id < 0 or (vocab is not None and token_id >= vocab):
                raise InvalidRequestError(
                    f"token id {token_id} is out of range for a vocabulary of {vocab} tokens", param="tokens"
                )
        if len(token_ids) > _DECODE_IN_THREAD_ABOVE:  # a long list takes a while: off the event loop
            return str(await asyncio.to_thread(codec.decode, list(token_ids), skip_special_tokens=False))
        return str(codec.decode(list(token_ids), skip_special_tokens=False))

    def token_str(self, token_id: int) -> str:
        """One token's text as OpenAI's logprobs show it."""
        return str(self._require_codec().decode([token_id], skip_special_tokens=False))


class StopStringMatcher:
    """Streams text while watching for stop strings that may span deltas.

    ``feed`` returns the text that is safe to emit now: anything that could still be the start of a stop
    string is held back until it is decided. When a stop string completes, the text before it (plus the
    string itself if ``include``) is emitted and ``stopped`` becomes the matched string.
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        buf = self._pending + text
        hit: tuple[int, str] | None = None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos >= 0 and (hit is None or pos < hit[0]):
                hit = (pos, stop)
        if hit is not None:
            pos, stop = hit
            self.stopped = stop
            self._pending = ""
            return buf[: pos + len(stop)] if self.include else buf[:pos]
        if not self.stops:
            self._pending = ""
            return buf
        keep = self.holdback
        cut = max(len(buf) - keep, 0)
        # Hold back only a suffix that is a prefix of some stop string.
        while cut < len(buf) and not any(s.startswith(buf[cut:]) for s in self.stops):
            cut += 1
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """At the end of generation: the held-back text (no stop string completed)."""
        out, self._pending = self._pending, ""
        return "" if self.stopped is not None else out
