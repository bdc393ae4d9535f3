"""Speculative decoding without a model: configuration, n-gram lookup, the acceptance rule (statistically),
and the scheduler's lookahead slots driven by fake outputs."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from app.engine.core.block_manager import BlockManager
from app.engine.core.sampling_params import SamplingParams
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence
from app.engine.metrics import EngineStats
from app.engine.spec_decode import (
    NgramProposer,
    Proposal,
    SpecDecodeStats,
    SpeculativeConfig,
    verify,
)

EOS = 2


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z = 3.719 is the one-sided p = 1e-4 point, so a
    correct implementation fails a test about once in 10,000 runs per check (the seeds are fixed anyway)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``probs``; categories with p = 0 must be empty."""
    n = sum(counts)
    stat, df = 0.0, -1
    for c, p in zip(counts, probs, strict=True):
        if p == 0.0:
            assert c == 0, "a token with zero target probability was emitted"
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    return stat, df


# ---- configuration -----------------------------------------------------------------------------------------


def test_config_from_dict_json_and_defaults() -> None:
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}'
    )
    assert cfg is not None and cfg.method == "ngram" and cfg.num_speculative_tokens == 3
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)
    only_max = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 3})
    assert only_max is not None and (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    default = SpeculativeConfig(method="ngram")
    assert (default.prompt_lookup_min, default.prompt_lookup_max, default.num_speculative_tokens) == (1, 4, 4)
    # A model without a method means a draft model.
    draft = SpeculativeConfig.parse({"model": "/some/folder", "num_speculative_tokens": 2})
    assert draft is not None and draft.method == "draft_model"
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse({}) is None
    assert SpeculativeConfig.parse(cfg) is cfg


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "needs a 'model'"),
        ({"method": "ngram", "model": "x"}, "takes no 'model'"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        ({"method": "ngram", "speculative_tokens": 2}, "unknown speculative_config key"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "dict or a JSON object"),
    ],
)
def test_config_errors_say_what_to_fix(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]


# ---- n-gram lookup -----------------------------------------------------------------------------------------


def reference_ngram(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The specification, slowly: longest n first, latest occurrence that leaves a token after it."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                extended = list(tokens)
                for j in range(i + n, i + n + k):  # past the end, the proposal copies itself
                    extended.append(extended[j])
                return extended[length:]
    return []


def test_ngram_prefers_longest_then_latest_match() -> None:
    prop = NgramProposer(1, 3)
    # "7 8 9" occurs earlier followed by 10 11; the last token alone (9) also occurs later, followed by 50.
    tokens = [7, 8, 9, 10, 11, 12, 9, 50, 51, 7, 8, 9]
    assert prop.propose(tokens, 3) == [10, 11, 12]
    # Only the 1-gram matches: its latest earlier occurrence wins.
    assert prop.propose([5, 1, 6, 1, 3, 1], 2) == [3, 1]
    # A recent occurrence: the repetition continues with its period (here 2) into the proposal.
    assert prop.propose([9, 4, 5, 4, 5], 5) == [4, 5, 4, 5, 4]
    assert prop.propose([3, 3, 3, 3], 3) == [3, 3, 3]
    assert prop.propose([1, 2, 3], 4) == []  # nothing repeats
    assert prop.propose([4], 4) == []
    assert NgramProposer(2, 2).propose([5, 1, 6, 1], 2) == []  # needs a 2-gram match


def test_ngram_matches_reference_and_ignores_byte_misalignment() -> None:
    rng = random.Random(3)
    prop = NgramProposer(1, 4)
    # Ids whose 8-byte encodings overlap when shifted (multiples of 256) would fool a plain byte search.
    alphabets = [list(range(4)), [0, 256, 65536, 1 << 24, 1 << 32], [0, 1, 256, 257]]
    for _ in range(300):
        alphabet = rng.choice(alphabets)
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 5)
        assert prop.propose(tokens, k) == reference_ngram(tokens, k, 1, 4), tokens
    # A case where the only byte match straddles two ids: [256, 0] is 00 01 00.. 00.., and the 1-gram
    # [1] (01 00 .. 00) occurs at byte 1, which is not an id boundary.
    assert prop.propose([256, 0, 5, 1], 2) == []


# ---- the acceptance rule -----------------------------------------------------------------------------------


def _emitted_distribution(
    p_rows: torch.Tensor, q_rows: torch.Tensor | None, trials: int, seed: int
) -> tuple[list[Counter[int]], float]:
    """Run verify() ``trials`` times for one proposal of len(p_rows) - 1 tokens drawn from ``q_rows`` (or a
    fixed n-gram guess when None); returns the emitted token counts per position and the acceptance rate."""
    g = torch.Generator().manual_seed(seed)
    k = p_rows.shape[0] - 1
    per_pos: list[Counter[int]] = [Counter() for _ in range(k + 1)]
    accepted = 0
    for _ in range(trials):
        if q_rows is None:
            tokens = [1] * k  # an n-gram guess: one-hot q
            prop = Proposal(tokens)
        else:
            tokens = torch.multinomial(q_rows, 1, generator=g).squeeze(1).tolist()
            prop = Proposal(tokens, q_rows)
        u = torch.rand(k, dtype=torch.float64, generator=g)
        u_final = torch.rand(k + 1, dtype=torch.float64, generator=g)
        [a], [final] = verify(p_rows, [prop], u, u_final)
        accepted += a
        emitted = [*tokens[:a], final]
        for j, t in enumerate(emitted):
            per_pos[j][t] += 1
    return per_pos, accepted / (trials * k)


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_first_emitted_token_follows_the_target_distribution(kind: str) -> None:
    # Position-independent p and q on a 6-token vocabulary (one token impossible under p); with one
    # proposal the first emitted token must be distributed exactly as p, whatever q is.
    p = torch.tensor([0.05, 0.30, 0.0, 0.25, 0.15, 0.25])
    q = torch.tensor([0.40, 0.10, 0.20, 0.10, 0.10, 0.10])
    p_rows = torch.stack([p, p])
    q_rows = torch.stack([q]) if kind == "draft" else None
    trials = 6000
    counts, rate = _emitted_distribution(p_rows, q_rows, trials, seed=1)
    stat, df = chi2_stat([counts[0][t] for t in range(6)], p.tolist())
    assert stat < chi2_critical(df), (stat, counts[0])
    # Theory: acceptance = sum(min(p, q)) for a draft; p(guess) for an n-gram guess.
    expected = float(torch.minimum(p, q).sum()) if kind == "draft" else float(p[1])
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / trials)


def test_multi_token_draft_keeps_each_position_on_target() -> None:
    # Different target and draft distributions at each of 3 positions (+ the bonus row). The emitted token
    # at position j, counted only in trials that reach it, must follow p_j: positions are independent here
    # because p_j does not depend on the earlier tokens.
    g = torch.Generator().manual_seed(7)
    p_rows = torch.softmax(torch.randn(4, 5, generator=g) * 1.5, dim=-1)
    q_rows = torch.softmax(torch.randn(3, 5, generator=g) * 1.5, dim=-1)
    counts, _ = _emitted_distribution(p_rows, q_rows, 8000, seed=2)
    for j in range(3):
        stat, df = chi2_stat([counts[j][t] for t in range(5)], p_rows[j].tolist())
        assert stat < chi2_critical(df), (j, stat, counts[j])


def test_greedy_rows_accept_exactly_the_argmax_prefix() -> None:
    one_hot = torch.eye(6)
    # The target picks 3, 4, 1, then 5. Proposal [3, 4, 2] matches two tokens, and the correction is 1.
    p_rows = one_hot[[3, 4, 1, 5]]
    u = torch.full((3,), 0.999, dtype=torch.float64)
    u_final = torch.full((4,), 0.5, dtype=torch.float64)
    assert verify(p_rows, [Proposal([3, 4, 2])], u, u_final) == ([2], [1])
    # All accepted: the bonus token is the target's next one.
    assert verify(p_rows, [Proposal([3, 4, 1])], u, u_final) == ([3], [5])
    # Two proposals in one batch, one of them empty (plain decode), rows laid out back to back.
    both = torch.cat([one_hot[[3, 4]], one_hot[[0]]])
    accepted, final = verify(both, [Proposal([3]), Proposal([])], u[:1], torch.zeros(3, dtype=torch.float64))
    assert (accepted, final) == ([1, 0], [4, 0])


def test_verify_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="target rows"):
        verify(torch.eye(4), [Proposal([1])], torch.zeros(1), torch.zeros(2))


def test_stats_counters_and_rendering() -> None:
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0, 0, 0])
    stats.record([3, 0, 2], [2, 0, 2])
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0]
    assert stats.acceptance_rate == pytest.approx(0.8)
    assert stats.mean_acceptance_length == pytest.approx(3.0)
    engine_stats = EngineStats(
        spec_decode_enabled=True,
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=5,
        spec_decode_num_accepted_tokens=4,
        spec_decode_num_accepted_tokens_per_pos=[2, 2, 0],
    )
    assert engine_stats.spec_decode_acceptance_rate == pytest.approx(0.8)


# ---- scheduler lookahead slots -----------------------------------------------------------------------------


def make_seq(rid: str, prompt: list[int], **params: object) -> Sequence:
    params.setdefault("max_tokens", 32)
    return Sequence(rid, prompt, SamplingParams(**params), eos_token_id=EOS)  # type: ignore[arg-type]


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **cfg: object) -> Scheduler:
    cfg.setdefault("num_lookahead_slots", 3)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))  # type: ignore[arg-type]


def prefill(sched: Scheduler, *seqs: Sequence, first_token: int = 10) -> None:
    """Admit ``seqs`` and run one step in which each samples ``first_token`` (no proposals yet)."""
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert out.num_lookahead_slots == {}  # no proposals while prefilling
    sched.update(out, {s.seq_id: first_token for s in out.scheduled})


def test_decodes_get_lookahead_slots_and_verified_tokens_count_as_computed() -> None:
    sched = make_scheduler()
    seq = make_seq("a", [3, 4, 5, 6, 7])
    prefill(sched, seq)
    out = sched.schedule()
    assert out.num_scheduled_tokens[seq.seq_id] == 1 and out.num_lookahead_slots[seq.seq_id] == 3
    # Slots for the pending token and three proposals: positions 5..8 -> blocks for 9 tokens.
    assert len(seq.block_table) == 3
    sched.update(out, {seq.seq_id: [11, 12, 13]})  # two proposals accepted + the model's token
    assert seq.output_token_ids == [10, 11, 12, 13]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 8
    assert len(seq.block_table) == 3  # 9 tokens still need all three blocks
    out = sched.schedule()
    sched.update(out, {seq.seq_id: [14]})  # everything rejected
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 9
    # The reserved blocks past the sequence's 10 tokens went back to the pool.
    assert len(seq.block_table) == 3
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 3


def test_lookahead_is_capped_by_max_tokens_and_max_model_len() -> None:
    sched = make_scheduler(num_lookahead_slots=4, max_model_len=12)
    seq = make_seq("a", [3, 4, 5, 6, 7], max_tokens=3)
    long = make_seq("b", list(range(3, 13)), max_tokens=None)  # 10 prompt tokens, limit 12
    prefill(sched, seq, long)
    out = sched.schedule()
    assert out.num_lookahead_slots[seq.seq_id] == 1  # 1 output so far: one proposal + the model's token = 3
    assert out.num_lookahead_slots[long.seq_id] == 1  # 11 tokens: position 11 is the last that may exist


def test_lookahead_counts_against_the_budget_and_never_preempts() -> None:
    sched = make_scheduler(num_lookahead_slots=3, max_num_batched_tokens=6)
    a, b = make_seq("a", [3, 4, 5]), make_seq("b", [6, 7, 8])
    prefill(sched, a, b)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens + sum(out.num_lookahead_slots.values()) <= 6
    assert out.num_lookahead_slots[a.seq_id] == 3 and out.num_lookahead_slots.get(b.seq_id, 0) == 1
    # Without free blocks for proposals, a decode uses what is left of its last block (or goes ahead
    # plainly) and nobody is preempted.
    tight = make_scheduler(num_blocks=3, block_size=4, num_lookahead_slots=4)
    c, d = make_seq("c", [3, 4, 5, 6, 7, 8]), make_seq("d", [9, 10, 11])
    prefill(tight, c, d)  # c: 7 tokens in 2 blocks, d: 4 tokens in 1 block; no block is free
    out = tight.schedule()
    assert not out.preempted
    assert out.num_scheduled_tokens == {c.seq_id: 1, d.seq_id: 1}
    assert out.num_lookahead_slots == {c.seq_id: 1}  # position 7, the last slot of c's second block


def test_lookahead_disabled_from_a_batch_size() -> None:
    sched = make_scheduler(lookahead_disable_batch_size=2)
    prefill(sched, make_seq("a", [3, 4, 5]))
    assert sched.schedule().num_lookahead_slots  # one running sequence: speculate
    sched = make_scheduler(lookahead_disable_batch_size=2)
    prefill(sched, make_seq("b", [3, 4, 5]), make_seq("c", [6, 7, 8]))
    assert sched.schedule().num_lookahead_slots == {}


def test_several_tokens_stop_at_max_tokens_and_free_blocks() -> None:
    sched = make_scheduler()
    seq = make_seq("a", [3, 4, 5, 6, 7], max_tokens=3)
    prefill(sched, seq)
    out = sched.schedule()
    finished = sched.update(out, {seq.seq_id: [11, 12, 13]})
    assert finished == [seq] and seq.output_token_ids == [10, 11, 12]
    assert seq.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
