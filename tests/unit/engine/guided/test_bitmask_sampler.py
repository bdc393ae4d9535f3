"""The grammar bitmask inside the batched sampler, on a tiny vocabulary: constrained rows only draw allowed
tokens, unconstrained rows are untouched (same tokens as without a mask), and the mask is applied once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import app.engine.sampler as sampler_module
from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from app.engine.guided.bitmask import TokenBitmask, apply_bitmask_torch, bitmask_words, unpack_bitmask
from app.engine.sampler import Sampler, SamplingRow

V = 70  # not a multiple of 32: the last word is partly padding
EOS = 2
GUIDED = StructuredOutputsParams(regex="a")  # any spec: the sampler only checks that rows are constrained


def make_bitmask(allowed: list[set[int] | None]) -> TokenBitmask:
    """Rows with a set are constrained to it; None rows are unconstrained (their mask row stays garbage)."""
    bitmask = torch.zeros(len(allowed), bitmask_words(V), dtype=torch.int32)
    bitmask[:] = 0x5A5A5A5A  # garbage in the rows that are not constrained: it must never be read
    rows = []
    for i, tokens in enumerate(allowed):
        if tokens is None:
            continue
        rows.append(i)
        words = [0] * bitmask_words(V)
        for t in tokens:
            words[t // 32] |= 1 << (t % 32)
        bitmask[i] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    return TokenBitmask(bitmask, rows)


def row(output: list[int] | None = None, guided: bool = False, **params: Any) -> SamplingRow:
    params.setdefault("max_tokens", 64)
    if guided:
        params["structured_outputs"] = GUIDED
    return SamplingRow(SamplingParams(**params), [1, 5, 7], output or [], 0, EOS)


def logits_for(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_unpack_and_apply_match_a_loop() -> None:
    allowed: list[set[int] | None] = [{0, 31, 32, 63, 64, 69}, None, set(range(5, 60, 3)), {69}]
    mask = make_bitmask(allowed)
    bits = unpack_bitmask(mask.bitmask, V)
    for i in mask.rows:
        assert set(bits[i].nonzero().squeeze(1).tolist()) == allowed[i]
    logits = logits_for(4)
    for rows in (mask.rows, [0, 2]):
        got = logits.clone()
        apply_bitmask_torch(got, mask.bitmask, rows)
        expected = logits.clone()
        for i in rows:
            for t in range(V):
                if t not in allowed[i]:  # type: ignore[operator]
                    expected[i, t] = float("-inf")
        assert torch.equal(got, expected)


def test_apply_matches_xgrammar_kernel() -> None:
    xgr = pytest.importorskip("xgrammar")
    bitmask = torch.randint(-(1 << 31), 1 << 31, (6, bitmask_words(V)), dtype=torch.int64).to(torch.int32)
    logits = logits_for(6, seed=3)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4]):
        ours, theirs = logits.clone(), logits.clone()
        apply_bitmask_torch(ours, bitmask, rows)
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=V, indices=rows)
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_masked_unconstrained_untouched(temperature: float) -> None:
    allowed: list[set[int] | None] = [{3, 40, 69}, None, {64}, None, set(range(33, 40))]
    mask = make_bitmask(allowed)
    rows = [row(guided=a is not None, temperature=temperature, seed=9) for a in allowed]
    free_rows = [row(temperature=temperature, seed=9) for _ in allowed]
    for seed in range(30):
        logits = logits_for(len(rows), seed)
        before = logits.clone()
        got = Sampler(seed=seed).sample(logits, rows, mask)
        plain = Sampler(seed=seed).sample(logits, free_rows)
        assert torch.equal(logits, before)  # the caller's logits are never written
        for i, tokens in enumerate(allowed):
            if tokens is None:
                assert got[i].token_id == plain[i].token_id  # untouched: what it would be without a mask
            else:
                assert got[i].token_id in tokens
        if temperature == 0.0:
            for i in mask.rows:
                best = max(allowed[i], key=lambda t, i=i: logits[i, t].item())  # type: ignore[arg-type]
                assert got[i].token_id == best


def test_mask_applied_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[int]] = []
    real = sampler_module.apply_bitmask

    def spy(logits: torch.Tensor, mask: TokenBitmask) -> None:
        calls.append(list(mask.rows))
        real(logits, mask)

    monkeypatch.setattr(sampler_module, "apply_bitmask", spy)
    allowed: list[set[int] | None] = [{5}, None, {6}, {7}, None]
    rows = [row(guided=a is not None, temperature=t) for a, t in zip(allowed, [0, 1, 1, 0, 1], strict=True)]
    got = Sampler(seed=0).sample(logits_for(5), rows, make_bitmask(allowed))
    assert calls == [[0, 2, 3]]  # one batched pass over the constrained rows, greedy and sampled alike
    assert [got[i].token_id for i in (0, 2, 3)] == [5, 6, 7]
    Sampler(seed=0).sample(logits_for(5), rows, None)
    Sampler(seed=0).sample(logits_for(5), rows, TokenBitmask(make_bitmask(allowed).bitmask, []))
    assert len(calls) == 1  # no mask, or one without constrained rows: nothing applied


def test_min_tokens_does_not_hold_eos_back_on_constrained_rows() -> None:
    # The grammar is complete: only eos is allowed. min_tokens must not mask it too (nothing would be left).
    mask = make_bitmask([{EOS}, None])
    rows = [row(guided=True, min_tokens=5, temperature=1.0), row(min_tokens=5, temperature=0.0)]
    logits = logits_for(2)
    logits[1, EOS] = 100.0
    got = Sampler(seed=0).sample(logits, rows, mask)
    assert got[0].token_id == EOS
    assert got[1].token_id != EOS  # the unconstrained row still holds eos back


def test_processed_logprobs_include_the_mask() -> None:
    mask = make_bitmask([{10, 11}])
    (res,) = Sampler(logprobs_mode="processed", seed=0).sample(
        logits_for(1), [row(guided=True, logprobs=3, temperature=1.0)], mask
    )
    assert res.token_id in (10, 11) and res.top_logprobs is not None
    top = list(res.top_logprobs.items())
    assert {t for t, _ in top[:2]} == {10, 11} and top[2][1] == float("-inf")
    assert abs(sum(torch.tensor([lp for _, lp in top[:2]]).exp().tolist()) - 1.0) < 1e-5


def test_best_of_rows_get_their_sampled_logprob() -> None:
    rows = [row(n=1, best_of=3, temperature=1.0), row(temperature=1.0)]
    logits = logits_for(2)
    res = Sampler(seed=0).sample(logits, rows)
    assert res[0].logprob is not None and res[0].top_logprobs == {}
    expected = logits[0].log_softmax(-1)[res[0].token_id].item()
    assert res[0].logprob == pytest.approx(expected, abs=1e-5)
    assert res[1].logprob is None
