"""Plain request and response records exchanged with LLM clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LLMRequest:
    """One chat request. ``prompt`` is the user message, or a full ``messages`` list when it is a list."""

    prompt: str | list[dict[str, Any]]
    system_prompt: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    response_format: Any = None
    stop: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def messages(self) -> list[dict[str, Any]]:
        """The OpenAI ``messages`` list this request stands for."""
        if isinstance(self.prompt, list):
            msgs = list(self.prompt)
        else:
            msgs = [{"role": "user", "content": self.prompt}]
        if self.system_prompt:
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs


@dataclass(slots=True)
class LLMResponse:
    """What an endpoint answered, with token counts and timings in milliseconds."""

    content: str
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    model: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    time_to_first_token_ms: float | None = None
    completion_time_ms: float | None = None
    queue_time_ms: float | None = None


#: what an embeddings request embeds: a text, texts, one token-id list, or token-id lists (OpenAI's ``input``)
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


@dataclass(slots=True)
class EmbeddingRequest:
    """One ``/v1/embeddings`` request: ``input`` as OpenAI takes it; ``dimensions`` shortens the vectors (models
    that can); ``extra_body`` fields are sent as they are, last."""

    input: EmbeddingInput
    dimensions: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def inputs(self) -> list[Any]:
        """The inputs as a list (one text or one token-id list becomes a list of one)."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


@dataclass(slots=True)
class EmbeddingResponse:
    """What an embeddings endpoint answered: one vector per input, in input order; ``input_tokens`` is the
    endpoint's ``usage.prompt_tokens`` (0 when it reports none); timings in milliseconds."""

    embeddings: list[list[float]]
    model: str | None = None
    input_tokens: int = 0
    completion_time_ms: float | None = None
    queue_time_ms: float | None = None
