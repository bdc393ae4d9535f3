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
