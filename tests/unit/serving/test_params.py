"""Request fields → SamplingParams, and every rejection names the field the client sent."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.serving.errors import APIError, from_validation_errors
from app.serving.params import (
    chat_sampling_params,
    completion_prompts,
    completion_sampling_params,
    param_of,
)
from app.serving.schemas import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


def test_chat_fields_map_to_vllm_sampling_params() -> None:
    p = chat_sampling_params(
        chat(
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            n=3,
            stop="x",
            seed=42,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias={"5": -100, "7": 2.5},
            logprobs=True,
            top_logprobs=3,
            ignore_eos=True,
            min_tokens=2,
            user="u",
            future_field={"ignored": True},
        )
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (7, 0.5, 0.9, 5, 0.1, 3)
    assert p.stop == ["x"] and p.seed == 42 and p.logprobs == 3 and p.ignore_eos and p.min_tokens == 2
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {5: -100.0, 7: 2.5}


def test_defaults_follow_openai() -> None:
    assert chat_sampling_params(chat()).max_tokens is None  # chat: as long as the context allows
    assert chat_sampling_params(chat(max_tokens=9)).max_tokens == 9
    assert chat_sampling_params(chat()).logprobs is None
    assert chat_sampling_params(chat(logprobs=True)).logprobs == 0
    p = completion_sampling_params(completion())
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.n == 1 and p.logprobs is None
    assert completion_sampling_params(completion(logprobs=0)).logprobs == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 2.0}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 3, "min_tokens": 5}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 500}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_values_name_their_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_sampling_params(chat(**fields))
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**70}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ],
)
def test_schema_errors_name_their_param(fields: dict[str, Any], param: str) -> None:
    model = CompletionRequest if "logprobs" in fields else ChatCompletionRequest
    body = {"messages": MSGS, "prompt": "x", **fields}
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = from_validation_errors(info.value.errors())
    assert err.status == 400 and err.param == param, err.message


def test_missing_and_non_object_bodies() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({})
    err = from_validation_errors(info.value.errors())
    assert err.param == "messages" and "required" in err.message


def test_completion_prompts_shapes() -> None:
    assert completion_prompts(completion(prompt="a")) == ["a"]
    assert completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    assert completion_prompts(completion(prompt=[1, 2, 3])) == [[1, 2, 3]]
    assert completion_prompts(completion(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    for bad in ([], [[]]):
        with pytest.raises(APIError) as info:
            completion_prompts(completion(prompt=bad))
        assert info.value.param == "prompt"


def test_param_of_reads_sampling_params_messages() -> None:
    assert param_of("top_p must be in (0, 1], got 2") == "top_p"
    assert param_of("stop_token_ids must be non-negative integers") == "stop_token_ids"
    assert param_of("min_tokens (5) must be less than or equal to max_tokens (3)") == "min_tokens"
    assert param_of("something else") is None
