"""Request fields → ``SamplingParams``, with every rejection reported against the field the client sent."""

from __future__ import annotations

import re
from typing import Any

from app.engine.core.sampling_params import SamplingParams
from app.serving.errors import APIError, bad_request
from app.serving.schemas import ChatCompletionRequest, CompletionRequest

# SamplingParams' messages start with the field name ("top_p must be in (0, 1], got 2.0").
_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "logit_bias",
    "temperature",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "n",
)
_FIELD_RE = re.compile(r"\b(" + "|".join(_FIELDS) + r")\b")
LOGIT_BIAS_LIMIT = 100.0
# OpenAI's default for /v1/completions; chat completions default to "as long as the context allows".
DEFAULT_COMPLETION_MAX_TOKENS = 16


def param_of(message: str) -> str | None:
    match = _FIELD_RE.search(message)
    return match.group(1) if match else None


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f'logit_bias keys must be token ids written as strings (e.g. {{"50256": -100}}), got {key!r}',
                "logit_bias",
            ) from None
        if token_id < 0:
            raise bad_request(f"logit_bias keys must be non-negative token ids, got {key!r}", "logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise bad_request(
                f"logit_bias values must be between -100 and 100, got {value} for token {key}", "logit_bias"
            )
        out[token_id] = value
    return out


def _common(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true", "stream_options")
    kwargs: dict[str, Any] = {
        "n": req.n,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "logit_bias": _logit_bias(req.logit_bias),
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    return kwargs


def _build(kwargs: dict[str, Any], renames: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = param_of(str(exc))
        param = renames.get(param, param) if param else None
        raise bad_request(str(exc), param) from None


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    kwargs = _common(req)
    renames: dict[str, str] = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        kwargs["max_tokens"] = req.max_completion_tokens
        renames["max_tokens"] = "max_completion_tokens"
    else:
        kwargs["max_tokens"] = req.max_tokens  # None: until the context length
    if req.logprobs:
        kwargs["logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs can only be set when logprobs is true", "top_logprobs")
    return _build(kwargs, renames)


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    kwargs = _common(req)
    kwargs["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    kwargs["logprobs"] = req.logprobs
    return _build(kwargs, {})


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a list of strings, token ids, or lists of token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    out: list[str | list[int]] = []
    for item in prompt:
        if isinstance(item, list) and not item:
            raise bad_request("prompt must not contain an empty list of token ids", "prompt")
        out.append(item if isinstance(item, str) else list(item))  # type: ignore[arg-type]
    return out


__all__ = [
    "APIError",
    "chat_sampling_params",
    "completion_prompts",
    "completion_sampling_params",
    "param_of",
]
