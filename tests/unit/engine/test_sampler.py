"""Sampler tests on CPU with hand-made logits: each option against a hand-computed expectation."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from app.engine.core.sampling_params import SamplingParams
from app.engine.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    check_params_for_vocab,
    seeded_uniform,
)

V = 64
EOS = 2


def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    *,
    seq_index: int = 0,
    eos: int | None = EOS,
    **params: Any,
) -> SamplingRow:
    params.setdefault("max_tokens", 64)
    return SamplingRow(SamplingParams(**params), prompt or [1], output or [], seq_index, eos)


def random_logits(batch: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def tokens(results: list[SampleResult]) -> list[int]:
    return [r.token_id for r in results]


def processed_logprobs(logits: torch.Tensor, **row_args: Any) -> torch.Tensor:
    """A single row's processed log-probs over the whole vocabulary (asked for as top_logprobs)."""
    (res,) = Sampler(logprobs_mode="processed").sample(logits, [row(logprobs=logits.shape[-1], **row_args)])
    assert res.top_logprobs is not None
    out = torch.empty(logits.shape[-1])
    for token_id, lp in res.top_logprobs.items():
        out[token_id] = lp
    return out


# ---- greedy ------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(8)
    before = logits.clone()
    res = Sampler().sample(logits, [row(temperature=0.0) for _ in range(8)])
    assert tokens(res) == logits.argmax(-1).tolist()
    assert all(r.logprob is None and r.top_logprobs is None for r in res)
    # with processing (penalties) the caller's tensor must not change either
    Sampler().sample(logits, [row([3, 4], temperature=0.0, repetition_penalty=1.5) for _ in range(8)])
    assert torch.equal(logits, before)


def test_greedy_on_non_contiguous_and_bfloat16_logits() -> None:
    full = random_logits(4 * 3).view(4, 3, V)
    last = full[:, -1, :]  # a strided view, as taken from [batch, seq, vocab] model outputs
    rows = [row(temperature=0.0, presence_penalty=0.1) for _ in range(4)]
    assert tokens(Sampler().sample(last, rows)) == last.argmax(-1).tolist()
    bf = last.to(torch.bfloat16)
    assert tokens(Sampler().sample(bf, [row(temperature=0.0)] * 4)) == bf.float().argmax(-1).tolist()


def test_near_zero_temperature_is_greedy() -> None:
    logits = random_logits(6, seed=3)
    res = Sampler(seed=1).sample(logits, [row(temperature=1e-6, top_k=5) for _ in range(6)])
    assert tokens(res) == logits.argmax(-1).tolist()


def test_greedy_rows_unaffected_by_sampled_rows() -> None:
    logits = random_logits(6, seed=1)
    greedy_rows = {0: row([5, 6], temperature=0.0, repetition_penalty=1.3), 3: row(temperature=0.0)}
    alone = {i: Sampler().sample(logits[i : i + 1], [r])[0].token_id for i, r in greedy_rows.items()}
    for trial in range(5):
        batch = [
            greedy_rows.get(i) or row(temperature=1.5, top_p=0.7, top_k=20, min_p=0.01, presence_penalty=1.0)
            for i in range(6)
        ]
        res = Sampler(seed=trial).sample(logits, batch)
        assert {i: res[i].token_id for i in greedy_rows} == alone


# ---- seeds -------------------------------------------------------------------------------------------------


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 1000  # not a multiple of the CDF block: exercises the padding path too
    target = random_logits(1, vocab, seed=7, scale=1.0)[0]
    fillers = random_logits(16, vocab, seed=8)
    seeded: dict[str, Any] = dict(temperature=0.9, top_p=0.9, top_k=400, min_p=0.001, seed=1234)

    def run(position: int, batch_size: int, where: int, sampler_seed: int) -> int:
        logits = fillers[:batch_size].clone()
        logits[where] = target
        rows = [
            row(output=[7] * (i % 3), temperature=1.0 + i / 10, top_p=0.5 + i / 40, seed=i if i % 2 else None)
            for i in range(batch_size)
        ]
        rows[where] = row(output=[9] * position, **seeded)
        return Sampler(seed=sampler_seed).sample(logits, rows)[where].token_id

    for position in range(8):
        reference = run(position, 1, 0, 0)
        for batch_size, where, sampler_seed in [(2, 1, 1), (7, 3, 2), (16, 15, 3), (16, 0, 4)]:
            assert run(position, batch_size, where, sampler_seed) == reference
    # ...and the positions do not all give the same token (the output position is part of the seed)
    assert len({run(p, 1, 0, 0) for p in range(8)}) > 2


def test_seed_reproducible_across_samplers_and_siblings_differ() -> None:
    logits = torch.zeros(1, V)  # uniform: every draw is informative

    def draws(seq_index: int, seed: int = 99) -> list[int]:
        return [
            Sampler().sample(logits, [row(output=[0] * pos, seq_index=seq_index, seed=seed)])[0].token_id
            for pos in range(20)
        ]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)  # n > 1 siblings with one seed must not produce the same sample
    assert draws(0) != draws(0, seed=100)


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(32, V)
    res = Sampler().sample(logits, [row() for _ in range(32)])
    assert len(set(tokens(res))) > 10


def test_seeded_uniform_range_and_spread() -> None:
    values = [seeded_uniform(5, 0, pos) for pos in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03
    assert seeded_uniform(-3, 1, 2, 3) == seeded_uniform(-3, 1, 2, 3)


# ---- truncation --------------------------------------------------------------------------------------------


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = random_logits(16, seed=4)
    greedy = logits.argmax(-1).tolist()
    assert tokens(Sampler().sample(logits, [row(temperature=1.3, top_k=1) for _ in range(16)])) == greedy
    assert tokens(Sampler().sample(logits, [row(temperature=1.3, top_p=1e-6) for _ in range(16)])) == greedy


def test_min_p_keeps_only_tokens_above_fraction_of_max() -> None:
    probs = torch.tensor([0.5, 0.3, 0.06, 0.04, 0.1])  # min_p 0.15: keep >= 0.075 -> {0, 1, 4}
    logits = probs.log().repeat(2000, 1)
    res = Sampler(seed=0).sample(logits, [row(min_p=0.15) for _ in range(2000)])
    counts = Counter(tokens(res))
    assert set(counts) == {0, 1, 4}
    assert counts[0] / 2000 == pytest.approx(0.5 / 0.9, abs=0.05)


def test_top_k_keeps_k_best() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]).repeat(1000, 1)
    res = Sampler(seed=0).sample(logits, [row(top_k=2) for _ in range(1000)])
    assert set(tokens(res)) == {1, 3}


# ---- penalties, bias, min_tokens (via the processed distribution) ------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    got = processed_logprobs(logits, prompt=[0, 1], output=[1, 5], temperature=0.0, repetition_penalty=2.0)
    expected = torch.tensor([1.0, -2.0, 0.5, 3.0, -2.0, 0.5]).log_softmax(-1)
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_frequency_and_presence_penalties_use_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    got = processed_logprobs(
        logits,
        prompt=[2, 2, 2],
        output=[3, 3, 0],
        temperature=0.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # token 3: 3 - 2*0.5 - 0.25 = 1.75; token 0: 2 - 0.5 - 0.25 = 1.25; prompt token 2 untouched
    expected = torch.tensor([1.25, -1.0, 0.5, 1.75, -2.0, 1.0]).log_softmax(-1)
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_penalties_combined_in_vllm_order() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    got = processed_logprobs(
        logits,
        prompt=[1],
        output=[0],
        temperature=0.5,
        seed=0,
        logit_bias={0: 1.0},
        repetition_penalty=2.0,
        frequency_penalty=1.0,
    )
    # bias: 3.0 -> repetition (seen in output): 1.5 -> frequency: 0.5; token 1 (prompt): -2.0; then / 0.5
    expected = (torch.tensor([0.5, -2.0, 0.5]) / 0.5).log_softmax(-1)
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler().sample(logits, [row(output=[0], temperature=0.0)])[0].token_id == 0
    assert Sampler().sample(logits, [row(output=[0], temperature=0.0, presence_penalty=0.2)])[0].token_id == 1
    assert (
        Sampler().sample(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.1)])[0].token_id == 1
    )


def test_logit_bias_forces_a_token() -> None:
    logits = random_logits(4, seed=5)
    rows = [row(temperature=0.0, logit_bias={17: 100.0}), row(temperature=1.0, logit_bias={17: 100.0})]
    rows += [row(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}), row(temperature=0.0)]
    res = tokens(Sampler().sample(logits, rows))
    assert res[:2] == [17, 17]
    assert res[2] == int(logits[2].topk(2).indices[1])
    assert res[3] == int(logits[3].argmax())


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 7], logits[0, 9] = 10.0, 9.0, 8.0
    params: dict[str, Any] = dict(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    sampler = Sampler()
    assert sampler.sample(logits, [row(output=[5, 5], **params)])[0].token_id == 9
    assert sampler.sample(logits, [row(output=[5, 5, 5], **params)])[0].token_id == EOS  # min_tokens reached
    # ignore_eos: eos is an ordinary token then, only the stop ids are masked
    assert sampler.sample(logits, [row(output=[5], ignore_eos=True, **params)])[0].token_id == EOS
    assert sampler.sample(logits, [row(output=[5], eos=None, **params)])[0].token_id == EOS
    res = Sampler(seed=0).sample(
        logits.repeat(200, 1), [row(min_tokens=1, stop_token_ids=[7]) for _ in range(200)]
    )
    assert not {EOS, 7} & set(tokens(res))


# ---- logprobs ----------------------------------------------------------------------------------------------


def test_logprobs_are_raw_by_default_with_sorted_top_n() -> None:
    logits = random_logits(3, seed=6)
    rows = [
        row(temperature=0.0, logprobs=5),
        row(temperature=0.7, top_k=3, repetition_penalty=1.5, prompt=[1, 2, 3], logprobs=2, seed=1),
        row(temperature=0.0, logprobs=0),
    ]
    res = Sampler().sample(logits, rows)
    raw = logits.log_softmax(-1)
    for i, r in enumerate(res):
        assert r.logprob == pytest.approx(float(raw[i, r.token_id]), abs=1e-6)
        assert r.top_logprobs is not None
        n = rows[i].params.logprobs
        assert n is not None and len(r.top_logprobs) == n
        top = raw[i].topk(n) if n else None
        if top is not None:
            assert list(r.top_logprobs) == top.indices.tolist()  # most probable first
            assert list(r.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=1e-6)
    assert res[2].top_logprobs == {}


def test_processed_logprobs_include_temperature() -> None:
    logits = random_logits(1, seed=9)
    r = row(temperature=0.5, logprobs=3, seed=4)
    (res,) = Sampler(logprobs_mode="processed").sample(logits, [r])
    assert res.logprob == pytest.approx(float((logits[0] / 0.5).log_softmax(-1)[res.token_id]), abs=1e-5)


# ---- statistics --------------------------------------------------------------------------------------------


def frequencies(probs: list[float], n: int, vocab: int | None = None, **params: Any) -> list[float]:
    vocab = vocab or len(probs)
    logits = torch.full((n, vocab), -math.inf)
    logits[:, : len(probs)] = torch.tensor(probs).log()
    # One shared SamplingParams (building 20k of them would dominate the test); seeded rows differ by
    # seq_index, which is part of the per-row seed like the output position is.
    shared = row(**params)
    rows = [SamplingRow(shared.params, [1], [], seq_index=i) for i in range(n)]
    counts = Counter(tokens(Sampler(seed=0).sample(logits, rows)))
    assert set(counts) <= set(range(len(probs)))
    return [counts[t] / n for t in range(len(probs))]


N = 10_000
TOL = 0.02  # 4 standard deviations of a frequency near 0.5 at N draws


def test_sampling_frequencies_match_a_known_distribution() -> None:
    assert frequencies([0.2, 0.3, 0.5], N) == pytest.approx([0.2, 0.3, 0.5], abs=TOL)
    assert frequencies([0.2, 0.3, 0.5], N, seed=11) == pytest.approx([0.2, 0.3, 0.5], abs=TOL)
    tempered = [p**0.5 for p in (0.2, 0.3, 0.5)]  # temperature 2 flattens: p^(1/2), renormalised
    expected = [p / sum(tempered) for p in tempered]
    assert frequencies([0.2, 0.3, 0.5], N, temperature=2.0) == pytest.approx(expected, abs=TOL)


def test_top_p_rejection_samples_the_renormalised_nucleus() -> None:
    # top_p 0.8 over [0.4, 0.3, 0.2, 0.1]: 0.4 + 0.3 < 0.8, so 0.2 is in, 0.1 out -> 4/9, 3/9, 2/9
    got = frequencies([0.4, 0.3, 0.2, 0.1], N, top_p=0.8)
    assert got == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0], abs=TOL)
    assert got[3] == 0.0
    # top_k 3 first leaves [2/9, 3/9, 4/9]; top_p 0.7 then drops 2/9 (4/9 + 3/9 >= 0.7) -> 3/7, 4/7
    got = frequencies([0.1, 0.2, 0.3, 0.4], N, top_p=0.7, top_k=3, seed=12)
    assert got == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7], abs=TOL)


def test_sampling_frequencies_over_a_wide_vocabulary() -> None:
    # Mass spread over several CDF blocks and a padded last block.
    vocab = 600
    logits = torch.full((N // 2, vocab), -math.inf)
    logits[:, [5, 300, 599]] = torch.tensor([0.3, 0.3, 0.4]).log()
    res = Sampler(seed=1).sample(logits, [row()] * (N // 2))
    counts = Counter(tokens(res))
    assert set(counts) == {5, 300, 599}
    assert counts[599] / (N // 2) == pytest.approx(0.4, abs=0.03)


# ---- contract ----------------------------------------------------------------------------------------------


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(torch.zeros(2, V), [row()])
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler().sample(torch.zeros(V), [row()])
    assert Sampler().sample(torch.zeros(0, V), []) == []
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="final")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logit_bias"):
        check_params_for_vocab(SamplingParams(logit_bias={V: 1.0}), V)
    with pytest.raises(ValueError, match="stop_token_ids"):
        check_params_for_vocab(SamplingParams(stop_token_ids=[V + 3]), V)
    check_params_for_vocab(SamplingParams(logit_bias={V - 1: 1.0}, stop_token_ids=[0]), V)


def test_out_of_vocabulary_history_does_not_touch_other_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    rows = [
        row(prompt=[3, 4], temperature=0.0, repetition_penalty=100.0, logit_bias={7: 50.0}),
        row(temperature=0.0),
    ]
    assert tokens(Sampler().sample(logits, rows)) == [2, 0]


def test_from_sequence() -> None:
    from app.engine.core.sequence import Sequence

    seq = Sequence("r", [1, 2, 3], SamplingParams(seed=5), eos_token_id=EOS, index=2)
    seq.append_token(4)
    r = SamplingRow.from_sequence(seq)
    assert (r.seq_index, r.eos_token_id, list(r.output_token_ids), r.params.seed) == (2, EOS, [4], 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_contract() -> None:
    logits = random_logits(8, 1000, seed=2).cuda()
    rows = [
        row(temperature=0.0, logprobs=2),
        row(temperature=0.8, top_p=0.9, top_k=50, seed=3, frequency_penalty=0.5),
    ]
    rows += [row(temperature=1.0, min_p=0.05, output=[1, 1, 2]) for _ in range(6)]
    res = Sampler().sample(logits, rows)
    assert res[0].token_id == int(logits[0].argmax())
    alone = Sampler().sample(logits[1:2], rows[1:2])[0].token_id
    assert res[1].token_id == alone
    bf = Sampler().sample(logits.bfloat16(), rows)
    assert bf[0].token_id == int(logits.bfloat16()[0].float().argmax())
