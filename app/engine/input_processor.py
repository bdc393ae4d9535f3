"""``InputProcessor``: prompts and options in, validated sequence groups out (vLLM's input ``Processor``).

Turns what callers pass (text, token ids, vLLM's prompt dicts, chat conversations) into token ids, checks
them against the model (vocabulary, context length) and builds the request's :class:`SequenceGroup`, with
the model's extra eos ids added as stop tokens. Invalid input raises ValueError before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from app.engine.core.sampling_params import SamplingParams
from app.engine.core.sequence import Sequence, SequenceGroup
from app.engine.sampler import check_params_for_vocab
from app.engine.tokenizer import Tokenizer

__all__ = ["InputProcessor", "PromptInput", "TokenizedPrompt"]

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptInput = str | list[int] | Mapping[str, Any]
# A prompt ready for the engine: its text (None when given as token ids) and its token ids.
TokenizedPrompt = tuple[str | None, list[int]]


class InputProcessor:
    """Tokenises and validates one model's requests."""

    def __init__(
        self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int, eos_token_ids: Seq[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id: int | None = int(eos_token_ids[0]) if eos_token_ids else None
        # The scheduler knows one eos id; the others stop a request like stop_token_ids (as in vLLM).
        self.extra_eos_ids = [int(i) for i in eos_token_ids[1:]]

    # ---- prompts ----
    @staticmethod
    def prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
        """One prompt or several, as a list (a flat list of ints is one prompt given as token ids)."""
        if isinstance(prompts, str | Mapping):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [items]  # type: ignore[list-item]  # one prompt given as token ids
        return items  # type: ignore[return-value]

    def tokenize(
        self, prompt: PromptInput | None, prompt_token_ids: Seq[int] | None = None
    ) -> TokenizedPrompt:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt_token_ids = prompt["prompt_token_ids"]
                prompt = None
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError("pass either a prompt or prompt_token_ids, not both")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = prompt_token_ids if prompt is None else prompt
        if ids is None:
            raise ValueError("a prompt (text or token ids) is required")
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(ids).__name__}")
        return None, list(ids)

    def render_chats(
        self,
        messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[TokenizedPrompt]:
        """One conversation (a list of ``{"role", "content"}`` messages) or a list of them, rendered with
        the model's chat template."""
        if not messages:
            raise ValueError("messages must not be empty")
        first = messages[0]
        conversations: list[Seq[Mapping[str, Any]]] = (
            [messages]  # type: ignore[list-item]
            if isinstance(first, Mapping)
            else list(messages)  # type: ignore[arg-type]
        )
        items: list[TokenizedPrompt] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            # The template writes the special tokens itself (BOS included where the model has one).
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return items

    # ---- requests ----
    def make_group(
        self,
        request_id: str,
        ids: list[int],
        sampling_params: SamplingParams | None,
        priority: int,
        arrival_time: float | None,
    ) -> SequenceGroup:
        """The request's sequences (``n`` of them), after checking its tokens and options."""
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: prompt token id {bad!r} is outside the vocabulary (size {vocab})"
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(ids)} tokens, more than the maximum "
                f"context length of {self.max_model_len}"
            )
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_params_for_vocab(params, vocab)
        if self.extra_eos_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_ids if t not in (params.stop_token_ids or ())]
            if extra:
                params = replace(params, stop_token_ids=[*(params.stop_token_ids or ()), *extra])
        seq = Sequence(
            request_id,
            ids,
            params,
            eos_token_id=self.eos_token_id,
            priority=priority,
            arrival_time=arrival_time,
        )
        return SequenceGroup.from_sequence(seq)
