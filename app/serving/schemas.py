"""Request bodies of the OpenAI-compatible API (with vLLM's extra sampling fields).

Unknown fields are ignored, as OpenAI does. Types and ranges that pydantic can check are checked here (a
400 naming the field); the rest is checked by ``SamplingParams`` and mapped back to the field by ``params``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app import json_limits

MAX_N = 128
MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT_MAX = 2**31 - 1

Float = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class _Request(_Body):
    """A whole request body: within ``app.json_limits`` (nesting depth, 64-bit integers), checked once at the top."""

    @model_validator(mode="before")
    @classmethod
    def _within_json_limits(cls, data: Any) -> Any:
        return json_limits.validate(data)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = Field(default=None, le=_INT_MAX)
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=_INT_MAX)
    min_p: Float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT_MAX)]] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    priority: int = Field(default=0, ge=-_INT_MAX, le=_INT_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=_INT_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("stream", mode="after")
    @classmethod
    def _stream_default(cls, value: bool | None) -> bool:
        return bool(value)


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def non_text_part(self) -> int | None:
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    return i
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, le=_INT_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


PromptType = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT_MAX)]]
