import pytest

from app.engine.core.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (16, 0, False, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.include_stop_str_in_output


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=None).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_resets_truncation() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -5}, "max_tokens must be at least 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -0.1}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"n": 0}, "n must be an integer >= 1"),
        ({"top_k": -2}, "top_k must be"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        (
            {"min_tokens": 5, "max_tokens": 4},
            r"min_tokens \(5\) must be less than or equal to max_tokens \(4\)",
        ),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"stop": ["ok", ""]}, "stop must not contain empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias for token 3 must be finite"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative"),
    ],
)
def test_validation_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_without_max_tokens_is_fine() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100
