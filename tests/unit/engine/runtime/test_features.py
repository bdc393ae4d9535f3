"""Stopping, sampling options, n > 1, validation, abort, chat and statistics of ``LLMEngine``."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from app.engine import LLMEngine, RequestOutput, SamplingParams
from tests.support.engine_runtime import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPT = random_prompts(1, 12, 12, seed=11)[0]


@pytest.fixture
def engine(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    return make_engine()


@pytest.fixture
def reference(engine: LLMEngine) -> RequestOutput:
    """The unconstrained greedy continuation of PROMPT (the engine is reused afterwards)."""
    return engine.generate([PROMPT], GREEDY)[0]


def _is_idle(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


# ---- stopping -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(engine: LLMEngine, reference: RequestOutput, include: bool) -> None:
    ref = reference.outputs[0]
    detok = engine.tokenizer
    # A stop string that starts inside one token's text and ends inside a later one.
    piece_ends = [len(detok.decode(ref.token_ids[: i + 1])) for i in range(len(ref.token_ids))]
    text = ref.text
    k = next(i for i in range(3, len(piece_ends) - 3) if piece_ends[i + 2] - piece_ends[i - 1] >= 3)
    start, stop_end = piece_ends[k - 1] - 1, piece_ends[k + 1] + 1
    stop = text[start:stop_end]
    first = text.find(stop)
    params = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
    )
    out = engine.generate([PROMPT], params)[0].outputs[0]
    expected = text[: first + len(stop)] if include else text[:first]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert ref.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(ref.token_ids)
    assert _is_idle(engine)


def test_stop_token_ids(engine: LLMEngine, reference: RequestOutput) -> None:
    ref = reference.outputs[0].token_ids
    i = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=[ref[i]])
    out = engine.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == ref[: i + 1]  # the stop token is reported in token_ids...
    assert out.text == engine.tokenizer.decode(ref[:i])  # ...but not in the text
    assert out.finish_reason == "stop" and out.stop_reason == ref[i]


def test_max_tokens_is_length(engine: LLMEngine, reference: RequestOutput) -> None:
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[
        0
    ].outputs[0]
    assert out.token_ids == reference.outputs[0].token_ids[:5]
    assert out.finish_reason == "length" and out.stop_reason is None


def test_eos_and_ignore_eos(engine: LLMEngine) -> None:
    eos = engine.eos_token_id
    assert eos is not None
    force = {eos: 100.0}  # make eos the argmax
    stopped = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=force))[0]
    assert stopped.outputs[0].token_ids == [eos] and stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].text == ""
    ignored = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=force, ignore_eos=True)
    )[0]
    assert ignored.outputs[0].token_ids == [eos] * 8 and ignored.outputs[0].finish_reason == "length"
    min_tok = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=force, min_tokens=3)
    )[0]
    assert len(min_tok.outputs[0].token_ids) == 4 and min_tok.outputs[0].token_ids[-1] == eos


# ---- sampling -------------------------------------------------------------------------------------------


def test_n2_with_seed(make_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    first = make_engine().generate([PROMPT], params)[0]
    assert [c.index for c in first.outputs] == [0, 1]
    a, b = (c.token_ids for c in first.outputs)
    assert len(a) == len(b) == 16 and a != b  # siblings draw differently
    # Same seed, other requests around it and another engine: the same samples.
    others = random_prompts(5, 3, 30, seed=12)
    again = make_engine(block_size=4).generate(others + [PROMPT], [GREEDY] * 5 + [params])[-1]
    assert [c.token_ids for c in again.outputs] == [a, b]
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]


def test_seeded_sampling_reproducible_unseeded_differs(make_engine: Callable[..., LLMEngine]) -> None:
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=123, max_tokens=24, ignore_eos=True)
    alone = make_engine().generate([PROMPT], seeded)[0].outputs[0].token_ids
    batch = random_prompts(7, 3, 30, seed=13)
    mixed = make_engine(max_num_batched_tokens=16).generate(batch + [PROMPT], seeded)[-1].outputs[0].token_ids
    assert alone == mixed
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    runs = make_engine(seed=None).generate([PROMPT] * 3, unseeded)
    assert len({tuple(r.outputs[0].token_ids) for r in runs}) > 1


def test_logprobs_present_and_absent(engine: LLMEngine) -> None:
    with_lp = engine.generate([PROMPT], SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=2))[0]
    c = with_lp.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert token_id in entry and 2 <= len(entry) <= 3 and all(v <= 0 for v in entry.values())
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(c.logprobs, c.token_ids, strict=True))
    )
    without = engine.generate([PROMPT], SamplingParams(max_tokens=3))[0].outputs[0]
    assert without.logprobs is None and without.cumulative_logprob is None


# ---- validation and abort -------------------------------------------------------------------------------


def test_invalid_input_raises_and_engine_keeps_serving(engine: LLMEngine, reference: RequestOutput) -> None:
    engine.add_request("keep", PROMPT, GREEDY)  # in flight while the bad ones are rejected
    engine.step()
    too_long = [5] * (engine.max_model_len + 1)
    bad_cases: list[tuple[object, SamplingParams | None, str]] = [
        ("", None, "empty"),
        ([], None, "no tokens"),
        (too_long, None, "maximum context length"),
        ([5, engine.vocab_size], None, "outside the vocabulary"),
        (PROMPT, SamplingParams(logit_bias={engine.vocab_size + 5: 1.0}), "outside the vocabulary"),
        (PROMPT, SamplingParams(stop_token_ids=[engine.vocab_size]), "outside the vocabulary"),
    ]
    for i, (prompt, params, message) in enumerate(bad_cases):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-{i}", prompt, params)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("keep", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="maximum context length"):  # all-or-nothing batch
        engine.generate([PROMPT, too_long], GREEDY)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    final = [o for o in outputs if o.finished]
    assert [o.request_id for o in final] == ["keep"]
    assert final[0].outputs[0].token_ids == reference.outputs[0].token_ids
    assert _is_idle(engine)


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", PROMPT[:5], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks < bm.num_blocks
    final = engine.abort_request("a")
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) == 3
    assert engine.abort_request("a") is None  # already gone
    assert engine.abort_request("b") is not None
    assert _is_idle(engine)
    assert engine.get_stats().request_success.get("abort") == 2


# ---- streaming via step(), chat, stats ------------------------------------------------------------------


def test_step_streams_cumulative_outputs(engine: LLMEngine, reference: RequestOutput) -> None:
    engine.add_request("s", PROMPT, GREEDY)
    seen: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert len(seen) == 32 and [o.finished for o in seen] == [False] * 31 + [True]
    assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 33))
    texts = [o.outputs[0].text for o in seen]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == reference.outputs[0].text


def test_chat(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    conv = [{"role": "user", "content": "hello"}]
    [single] = engine.chat(conv, params)
    assert single.prompt is not None and single.prompt.startswith("<|im_start|>user\nhello")
    assert single.prompt_token_ids[0] == engine.tokenizer.token_to_id("<|im_start|>")
    pair = engine.chat([conv, [{"role": "user", "content": "the fox"}]], params)
    assert len(pair) == 2 and pair[0].outputs[0].token_ids == single.outputs[0].token_ids


def test_stats_and_request_metrics(engine: LLMEngine) -> None:
    outputs = engine.generate(
        random_prompts(3, 5, 9, seed=14), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    m = outputs[0].metrics
    assert m is not None and m.num_generation_tokens == 4 and len(m.inter_token_latencies) == 3
    assert m.time_to_first_token is not None and m.queue_time is not None and m.e2e_latency is not None
    assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    stats = engine.get_stats()
    assert stats.generation_tokens == 12
    assert stats.prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
    assert stats.request_success == {"length": 3}
    assert stats.time_to_first_token_seconds.count == 3 and stats.inter_token_latency_seconds.count == 9
    assert stats.num_requests_running == stats.num_requests_waiting == 0


def test_engine_config_errors(make_engine: Callable[..., LLMEngine]) -> None:
    with pytest.raises(TypeError, match="unknown engine option"):
        make_engine(max_num_seq=4)
    with pytest.raises(ValueError, match="block_size"):
        make_engine(block_size=0)
    with pytest.raises(ValueError, match="holds no block"):
        make_engine(kv_cache_memory_bytes=10)
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(max_model_len=10**6)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_engine(scheduling_policy="lifo")


def test_generate_input_forms(engine: LLMEngine, reference: RequestOutput) -> None:
    four = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = reference.outputs[0].token_ids[:4]
    single_ids = engine.generate(PROMPT, four)  # one prompt given as token ids
    as_dict = engine.generate([{"prompt_token_ids": PROMPT}], four)
    per_prompt = engine.generate([PROMPT, PROMPT], [four, SamplingParams(temperature=0.0, max_tokens=2)])
    assert single_ids[0].outputs[0].token_ids == as_dict[0].outputs[0].token_ids == expected
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [4, 2]
    text = engine.tokenizer.decode(PROMPT)
    assert engine.generate(text, four)[0].prompt == text
    assert engine.generate([], four) == []
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([PROMPT, PROMPT], [four])
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        engine.generate([{"text": "x"}], four)
    assert _is_idle(engine)


def test_stop_string_on_the_last_token_reports_stop(engine: LLMEngine, reference: RequestOutput) -> None:
    ref = reference.outputs[0]
    prefixes = [engine.tokenizer.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    ends = [len(p) for p in prefixes]

    def clean(i: int) -> bool:  # the decoded prefix is final text (no split multi-byte character)
        return ref.text.startswith(prefixes[i]) and not prefixes[i].endswith("\ufffd")

    k = next(
        i
        for i in range(4, len(ends))
        if ends[i] - ends[i - 2] >= 2
        and clean(i)
        and clean(i - 2)
        and "\ufffd" not in ref.text[ends[i - 2] : ends[i]]
    )
    stop = ref.text[ends[k - 2] : ends[k]]
    if ref.text.find(stop) != ends[k - 2]:
        pytest.skip("the stop string occurs earlier in this continuation")
    params = SamplingParams(temperature=0.0, max_tokens=k + 1, ignore_eos=True, stop=stop)
    out = engine.generate([PROMPT], params)[0].outputs[0]
    assert len(out.token_ids) == k + 1
    assert out.text == ref.text[: ends[k - 2]]
    assert out.finish_reason == "stop" and out.stop_reason == stop
