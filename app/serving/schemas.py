"""Request bodies of the OpenAI-compatible API (with vLLM's extra sampling and structured-output fields).

Truly unknown top-level fields are kept aside (``model_extra``) and ignored, as vLLM does; the server logs
their names at debug level. OpenAI fields this server cannot honour are declared (as ``Any``) so that
``params.reject_unsupported`` can answer a 400 naming them. Types and ranges that pydantic can check are
checked here (a 400 naming the field); the rest is checked by ``SamplingParams``, ``structured`` and ``tools``
and mapped back to the field the client sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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


class _Forwarded(_Body):
    """A nested object a proxy backend forwards upstream as sent: unknown keys are kept (``model_dump``)."""

    model_config = ConfigDict(extra="allow")


class _OpenRequest(_Request):
    """A generation request: unknown top-level fields are kept in ``model_extra`` (logged, then ignored)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---------------------------------------------------------------------------------------------- structure
class JsonSchemaFormat(_Forwarded):
    """OpenAI's ``response_format.json_schema``: ``{"name", "description", "schema", "strict"}``."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Forwarded):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object: {\"name\": ..., \"schema\": {...}}")
        return self


class StructuredOutputsRequest(_Forwarded):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None


class _StructuredFields(_OpenRequest):
    """Constrained output, in OpenAI's and vLLM's spellings (``structured``: at most one source)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Any = None  # vLLM's: the engine has one backend; ignored (debug log)
    guided_whitespace_pattern: Any = None  # vLLM's: ignored (debug log)


class _SamplingFields(_StructuredFields):
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
    # the native engine's residual-stream interventions (steering vectors, zeroed heads), this request only
    interventions: list[dict[str, Any]] | None = Field(default=None, max_length=64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("stream", mode="after")
    @classmethod
    def _stream_default(cls, value: bool | None) -> bool:
        return bool(value)


class TextPart(_Body):
    type: str
    text: str | None = None


class ToolCallFunction(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a JSON object is accepted too


class ToolCall(_Body):
    """An earlier assistant turn's call, as OpenAI returned it."""

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

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


# ---------------------------------------------------------------------------------------------- tools
class FunctionDefinition(_Forwarded):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(_Forwarded):
    type: str  # only "function" is served (tools.plan_tools says so, naming the tool)
    function: FunctionDefinition | None = None


class NamedFunction(_Forwarded):
    name: str = Field(min_length=1)


class NamedToolChoice(_Forwarded):
    type: str
    function: NamedFunction | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, le=_INT_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields this server does not serve: a 400 naming them when set (params.reject_unsupported)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    store: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: Any = None
    moderation: Any = None
    # OpenAI fields that change nothing here (bookkeeping and cache hints): accepted and ignored
    metadata: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None


PromptType = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: Any = None  # not served: a 400 when set (params.reject_unsupported)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT_MAX)]]


# ---------------------------------------------------------------------------------------------- embeddings
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(_Request):
    """OpenAI's ``/v1/embeddings`` body: ``input`` is a string, a list of strings, a list of token ids or a list
    of such lists (token ids are used as given: no special tokens added)."""

    model: str | None = None
    input: str | list[str] | list[Annotated[int, Field(ge=0, le=_INT_MAX)]] | list[
        list[Annotated[int, Field(ge=0, le=_INT_MAX)]]
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be an empty string")
            return value
        if not value:
            raise ValueError("input must not be an empty list")
        if len(value) > MAX_EMBEDDING_INPUTS and not isinstance(value[0], int):
            raise ValueError(f"input holds {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per request")
        for index, item in enumerate(value):
            if isinstance(item, str | list) and not item:
                raise ValueError(f"input[{index}] is empty: every input needs at least one character or token")
        return value


class ActivationsRequest(_Request):
    """``/v1/activations``: the residual stream of a prompt after ``layers`` (Hugging Face's ``hidden_states[L +
    1]``) at ``positions``."""

    model: str | None = None
    prompt: str | list[Annotated[int, Field(ge=0, le=_INT_MAX)]] | None = None
    messages: list[ChatMessage] | None = None
    layers: list[Annotated[int, Field(ge=0, le=_INT_MAX)]] = Field(min_length=1, max_length=1024)
    positions: Literal["last", "all"] | list[Annotated[int, Field(ge=0, le=_INT_MAX)]] = "last"
    encoding_format: Literal["float", "base64"] = "float"
    add_generation_prompt: bool = True
