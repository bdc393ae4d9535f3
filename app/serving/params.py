"""Request fields → ``SamplingParams``, with every rejection reported against the field the client sent.

OpenAI fields this server cannot honour are refused here with a 400 naming them (``UNSUPPORTED``); fields
nobody knows are ignored, with a debug log line naming them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from app.engine.core.sampling_params import SamplingParams
from app.serving.errors import APIError, bad_request
from app.serving.schemas import ChatCompletionRequest, CompletionRequest
from app.serving.structured import Structure, request_structure

log = logging.getLogger(__name__)

# SamplingParams' messages start with the field name ("top_p must be in (0, 1], got 2.0").
_FIELDS = (
    "structured_outputs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "logit_bias",
    "temperature",
    "max_tokens",
    "min_tokens",
    "best_of",
    "logprobs",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "n",
    "interventions",
    "capture",
)
_FIELD_RE = re.compile(r"\b(" + "|".join(_FIELDS) + r")\b")
LOGIT_BIAS_LIMIT = 100.0
# OpenAI's default for /v1/completions; chat completions default to "as long as the context allows".
DEFAULT_COMPLETION_MAX_TOKENS = 16


def _unset(value: Any) -> bool:
    return value is None


# field -> (is the value one we can serve?, why not)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_unset, "'functions' is deprecated and not served here: send 'tools' instead"),
    "function_call": (_unset, "'function_call' is deprecated and not served here: send 'tool_choice' instead"),
    "audio": (_unset, "audio output is not supported by this server"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output (modalities ['text']) is supported"),
    "prediction": (_unset, "predicted outputs ('prediction') are not supported by this server"),
    "web_search_options": (_unset, "web search is not supported by this server"),
    "store": (lambda v: not v, "stored completions ('store': true) are not supported by this server"),
    "reasoning_effort": (_unset, "'reasoning_effort' is not supported: the served model has no reasoning mode"),
    "verbosity": (_unset, "'verbosity' is not supported by this server"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "this server has one service tier: 'auto'"),
    "moderation": (_unset, "'moderation' is not supported by this server"),
    "suffix": (lambda v: v in (None, ""), "'suffix' (insertion) is not supported by this server"),
}


def reject_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the first OpenAI field set to something this server cannot serve; unknown fields logged."""
    for name, (ok, why) in UNSUPPORTED.items():
        if name in type(req).model_fields and not ok(getattr(req, name)):
            raise bad_request(why, name)
    if req.model_extra:
        log.debug("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))


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


class _Requested:
    """The default of ``structure=``: the constraint the request's own fields ask for."""


REQUESTED = _Requested()


def _common(
    req: ChatCompletionRequest | CompletionRequest, structure: Structure | _Requested | None
) -> tuple[dict[str, Any], dict[str, str]]:
    reject_unsupported(req)
    if isinstance(structure, _Requested):
        structure = request_structure(req)
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
    if req.interventions is not None:
        kwargs["interventions"] = req.interventions
    renames: dict[str, str] = {}
    if structure is not None:
        kwargs["structured_outputs"] = structure.params
        renames["structured_outputs"] = structure.param
    return kwargs, renames


def _build(kwargs: dict[str, Any], renames: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = param_of(str(exc))
        param = renames.get(param, param) if param else None
        raise bad_request(str(exc), param) from None


def chat_sampling_params(
    req: ChatCompletionRequest, structure: Structure | _Requested | None = REQUESTED
) -> SamplingParams:
    """``structure``: the output constraint (the tools' or the request's); by default the request's own."""
    kwargs, renames = _common(req, structure)
    renames["logprobs"] = "top_logprobs"
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


def completion_sampling_params(
    req: CompletionRequest, structure: Structure | _Requested | None = REQUESTED
) -> SamplingParams:
    kwargs, renames = _common(req, structure)
    kwargs["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    kwargs["logprobs"] = req.logprobs
    if req.best_of is not None:
        if req.best_of < req.n:
            raise bad_request(f"best_of ({req.best_of}) must be greater than or equal to n ({req.n})", "best_of")
        if req.stream and req.best_of > req.n:
            raise bad_request("best_of greater than n cannot be used with stream", "best_of")
        kwargs["best_of"] = req.best_of
    return _build(kwargs, renames)


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
    "REQUESTED",
    "UNSUPPORTED",
    "APIError",
    "chat_sampling_params",
    "completion_prompts",
    "completion_sampling_params",
    "param_of",
    "reject_unsupported",
]
