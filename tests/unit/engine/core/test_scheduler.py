"""Scheduler tests driven on CPU: each step is schedule() → made-up sampled tokens → update()."""

from __future__ import annotations

import random
from typing import Any

import pytest

from app.engine.core.scheduler import QueueFullError, SchedulerConfig
from app.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.support.engine_core import (
    EOS,
    FakeRunner,
    drain_and_replay,
    make_scheduler,
    make_seq,
    random_step,
    run_to_completion,
    scheduled,
    step,
)

# ---- basic flow ----


def test_prefill_then_decode_until_max_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 6, max_tokens=3)
    sched.add(seq)
    out, fin = step(sched)
    assert scheduled(out) == {"a/0": 6} and seq.output_token_ids == [100]
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 6
    out, fin = step(sched)
    assert scheduled(out) == {"a/0": 1} and fin == []
    out, fin = step(sched)
    assert fin == [seq] and seq.output_token_ids == [100, 101, 102]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"
    assert sched.block_manager.kv_cache_usage_perc == 0.0 and not sched.has_unfinished()
    assert sched.schedule().is_empty


def test_continuous_batching_admits_while_others_decode() -> None:
    sched = make_scheduler()
    a = make_seq("a", 5, max_tokens=10)
    sched.add(a)
    step(sched)
    step(sched)
    b = make_seq("b", 7, max_tokens=2)
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 1, "b/0": 7}
    assert out.scheduled == [a, b]  # decodes first
    out, fin = step(sched)
    assert scheduled(out) == {"a/0": 1, "b/0": 1} and fin == [b]
    assert sched.stats().num_running == 1


def test_token_budget_respected_every_step() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8)
    seqs = [make_seq(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 8)) for i in range(20)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        step(sched)  # step() asserts the budget
        assert len(sched.running) <= 8
        steps += 1
    assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)
    total = sum(s.num_prompt_tokens + s.num_output_tokens - 1 for s in seqs)
    assert steps >= total / 16


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq("a", 3, max_tokens=20)
    sched.add(a)
    step(sched)
    long = make_seq("long", 20, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out, _ = step(sched)
        assert out.num_scheduled_tokens[a.seq_id] == 1  # a decodes every step
        chunks.append(out.num_scheduled_tokens[long.seq_id])
        if long.num_computed_tokens < 20:
            assert long.output_token_ids == []  # a partial chunk samples nothing
    assert chunks == [7, 7, 6] and long.num_computed_tokens == 20
    assert long.output_token_ids == [100]


def test_long_prefill_token_threshold_caps_one_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    sched.add(make_seq("a", 12))
    sched.add(make_seq("b", 3))
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 5, "b/0": 3}


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    sched = make_scheduler(
        num_blocks=16, enable_chunked_prefill=False, max_num_batched_tokens=10, max_model_len=10
    )
    sched.add(make_seq("a", 6))
    sched.add(make_seq("b", 6))
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 6}  # b does not fit the remaining 4 tokens and is not split
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 1, "b/0": 6}
    with pytest.raises(ValueError, match=r"without chunked prefill, max_num_batched_tokens \(8\)"):
        make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=10)


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"r{i}", 4, max_tokens=2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.stats().num_waiting == 1
    out, fin = step(sched)
    assert len(fin) == 2
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r2"]


# ---- ordering and preemption ----


def test_fcfs_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for rid, t in (("late", 3.0), ("early", 1.0), ("mid", 2.0)):
        sched.add(make_seq(rid, 4, arrival=t, max_tokens=1))
    assert [s.request_id for s in run_to_completion(sched)] == ["early", "mid", "late"]


def test_priority_order() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio, t in (("p5", 5, 1.0), ("p1-late", 1, 3.0), ("p1", 1, 2.0), ("p0", 0, 4.0)):
        sched.add(make_seq(rid, 4, priority=prio, arrival=t, max_tokens=1))
    assert [s.request_id for s in run_to_completion(sched)] == ["p0", "p1", "p1-late", "p5"]


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_seq("a", 4, max_tokens=5))
    step(sched)
    sched.add(make_seq("b", 4, max_tokens=1, priority=-10))
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 1} and out.preempted == []


def test_priority_preemption_for_seats() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    low = make_seq("low", 4, priority=5, max_tokens=4)
    sched.add(low)
    step(sched)
    step(sched)
    high = make_seq("high", 4, priority=0, max_tokens=2)
    sched.add(high)
    out, _ = step(sched)
    assert out.preempted == [low] and scheduled(out) == {"high/0": 4}
    assert low.status is SequenceStatus.WAITING and low.num_computed_tokens == 0 and low.block_table == []
    assert low.output_token_ids == [100, 101] and sched.stats().num_preemptions == 1
    # The equal-priority newcomer does not preempt, and low resumes with its outputs recomputed.
    sched.add(make_seq("same", 4, priority=5, max_tokens=1))
    finished = run_to_completion(sched)
    assert [s.request_id for s in finished] == ["high", "low", "same"]
    assert low.output_token_ids == [100, 101, 102, 103]


def test_priority_preemption_for_blocks() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")
    low = make_seq("low", 10, priority=1, max_tokens=3)
    sched.add(low)
    step(sched)  # 3 blocks
    high = make_seq("high", 6, priority=0, max_tokens=1)
    sched.add(high)
    out, fin = step(sched)  # needs 2 blocks, only 1 is free
    assert out.preempted == [low] and scheduled(out) == {"high/0": 6} and fin == [high]
    assert run_to_completion(sched) == [low]
    assert low.num_output_tokens == 3


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_when_blocks_run_out(prefix_caching: bool) -> None:
    # 6 blocks of 4 tokens; two sequences of 8 prompt tokens growing to 20 tokens each cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, prefix_caching=prefix_caching)
    a = make_seq("a", [1] * 8, arrival=1.0, max_tokens=12)
    b = make_seq("b", [2] * 8, arrival=2.0, max_tokens=12)
    sched.add(a)
    sched.add(b)
    preempted: list[Sequence] = []
    finished: list[Sequence] = []
    recompute_tokens = None
    while sched.has_unfinished():
        out, fin = step(sched)
        finished += fin
        if b in out.scheduled and b.num_preemptions and recompute_tokens is None:
            recompute_tokens = out.num_scheduled_tokens[b.seq_id]
        preempted += out.preempted
    assert preempted and set(preempted) == {b}  # the latest arrival is the victim
    assert sched.stats().num_preemptions == len(preempted)
    assert finished[0] is a
    expected = [100 + i for i in range(12)]
    assert a.output_token_ids == expected and b.output_token_ids == expected
    assert recompute_tokens is not None and recompute_tokens > 8  # prompt + kept outputs are recomputed
    assert sched.block_manager.kv_cache_usage_perc == 0.0


def test_a_lone_sequence_stops_at_cache_capacity() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    seq = make_seq("a", 5, max_tokens=None)
    sched.add(seq)
    run_to_completion(sched)
    assert seq.num_tokens == 8 and seq.status is SequenceStatus.FINISHED_LENGTH
    assert sched.stats().num_preemptions == 0


# ---- requests in and out ----


def test_abort_waiting_and_running() -> None:
    sched = make_scheduler(max_num_seqs=1)
    run, wait = make_seq("run", 6, max_tokens=10), make_seq("wait", 6)
    sched.add(run)
    sched.add(wait)
    step(sched)
    assert sched.abort("wait") and wait.status is SequenceStatus.FINISHED_ABORTED
    assert sched.stats().num_waiting == 0 and wait.finish_reason == "abort"
    assert sched.block_manager.kv_cache_usage_perc > 0
    assert sched.abort("run") and run.status is SequenceStatus.FINISHED_ABORTED
    assert sched.block_manager.kv_cache_usage_perc == 0.0 and sched.running == []
    assert not sched.abort("run") and not sched.abort("nope")
    assert not sched.has_unfinished()


def test_abort_between_schedule_and_update() -> None:
    sched = make_scheduler()
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, {a.seq_id: 1, b.seq_id: 1}) == []
    assert a.output_token_ids == [] and b.output_token_ids == [1]


def test_bounded_waiting_queue() -> None:
    sched = make_scheduler(max_waiting=2)
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 4))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        sched.add(make_seq("c", 4))
    assert "c" not in sched.requests
    step(sched)  # admits a and b
    sched.add(make_seq("c", 4))


def test_add_validation() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_model_len=20)
    sched.add(make_seq("a", 4))
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        sched.add(make_seq("a", 4))
    with pytest.raises(
        ValueError, match="the prompt has 21 tokens, more than the maximum sequence length of 20"
    ):
        sched.add(make_seq("b", 21))
    with pytest.raises(ValueError, match=r"n=5 exceeds max_num_seqs=4"):
        sched.add(make_seq("c", 4, n=5))
    with pytest.raises(ValueError, match="policy must be 'fcfs' or 'priority'"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_missing_sampled_token_is_an_error_and_changes_nothing() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 4)
    sched.add(seq)
    out = sched.schedule()
    with pytest.raises(ValueError, match=f"no sampled token for sequence {seq.seq_id}"):
        sched.update(out, {})
    assert seq.num_computed_tokens == 0
    sched.update(out, {seq.seq_id: 5})
    assert seq.output_token_ids == [5]


# ---- stop conditions ----


def finish_with(tokens: list[int], **params: Any) -> Sequence:
    sched = make_scheduler()
    seq = make_seq("a", 4, **params)
    sched.add(seq)
    it = iter(tokens)
    while sched.has_unfinished():
        step(sched, lambda _s: next(it))
    return seq


def test_stop_on_eos() -> None:
    seq = finish_with([5, EOS, 6], max_tokens=10)
    assert seq.output_token_ids == [5, EOS] and seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.finish_reason == "stop" and seq.stop_reason is None


def test_ignore_eos() -> None:
    seq = finish_with([EOS] * 5, max_tokens=5, ignore_eos=True)
    assert seq.output_token_ids == [EOS] * 5 and seq.finish_reason == "length"


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    seq = finish_with([EOS, 7, 5, EOS], max_tokens=10, min_tokens=3, stop_token_ids=[7])
    assert seq.output_token_ids == [EOS, 7, 5, EOS] and seq.finish_reason == "stop"


def test_stop_token_ids() -> None:
    seq = finish_with([5, 6, 9, 5], max_tokens=10, stop_token_ids=[9])
    assert seq.output_token_ids == [5, 6, 9] and seq.stop_reason == 9 and seq.finish_reason == "stop"


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    seq = finish_with([5, EOS], max_tokens=2)
    assert seq.finish_reason == "stop"


def test_max_model_len_stops_generation() -> None:
    sched = make_scheduler(max_model_len=6)
    seq = make_seq("a", 4, max_tokens=None)
    sched.add(seq)
    run_to_completion(sched)
    assert seq.num_tokens == 6 and seq.finish_reason == "length"


def test_multi_token_update_stops_at_first_stop() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 4, max_tokens=10)
    sched.add(seq)
    out = sched.schedule()
    assert sched.update(out, {seq.seq_id: [5, EOS, 6]}) == [seq]
    assert seq.output_token_ids == [5, EOS]


def test_stop_string_hook_finishes_and_frees() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 4, max_tokens=10)
    sched.add(seq)
    step(sched)
    sched.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, "###")
    assert seq.stop_reason == "###" and seq.finish_reason == "stop"
    assert sched.block_manager.kv_cache_usage_perc == 0.0 and not sched.has_unfinished()
    other = make_seq("b", 4)
    sched.add(other)
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_sequence(other, SequenceStatus.RUNNING)


# ---- prefix caching through the scheduler ----


def test_prefix_hits_for_a_second_request() -> None:
    sched = make_scheduler(block_size=4)
    shared = list(range(50, 62))  # 12 tokens = 3 blocks
    first = make_seq("a", [*shared, 1, 2], max_tokens=1)
    sched.add(first)
    run_to_completion(sched)
    second = make_seq("b", [*shared, 3], max_tokens=1)
    sched.add(second)
    out, _ = step(sched)
    assert scheduled(out) == {"b/0": 1} and second.num_cached_tokens == 12
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14 + 13, 12)
    assert stats.num_cached_blocks == 3  # both prompts' last blocks were partial


def test_preempted_sequence_recomputes_from_its_own_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1, policy="priority")
    low = make_seq("low", 9, priority=1, max_tokens=5)
    sched.add(low)
    step(sched)
    step(sched)
    sched.add(make_seq("high", 4, priority=0, max_tokens=1))
    step(sched)  # preempts low; its blocks stay cached while free
    out, _ = step(sched)
    # 11 tokens (9 prompt + 2 outputs), 8 of them in two cached full blocks: 3 recomputed
    assert low.num_cached_tokens == 8 and out.num_scheduled_tokens[low.seq_id] == 3
    assert low.output_token_ids == [100, 101, 102]


# ---- n > 1 ----


def test_n_samples_share_the_prompt_blocks() -> None:
    sched = make_scheduler(block_size=4)
    parent = make_seq("a", 10, n=3, max_tokens=3)
    group = sched.add(parent)
    assert len(group.seqs) == 3 and [s.index for s in group.seqs] == [0, 1, 2]
    assert sched.stats().num_waiting == 1
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 8}  # up to the fork point: the last full block before the tail
    children = group.seqs[1:]
    assert all(c.status is SequenceStatus.RUNNING for c in children)
    bm = sched.block_manager
    assert [bm.blocks[b].ref_count for b in parent.block_table[:2]] == [3, 3]
    assert all(c.block_table == parent.block_table[:2] and c.num_computed_tokens == 8 for c in children)
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 2, "a/1": 2, "a/2": 2}
    assert len({s.block_table[2] for s in group.seqs}) == 3  # each writes its own last block
    finished = run_to_completion(sched)
    assert set(finished) == set(group.seqs)
    assert [s.output_token_ids[0] for s in group.seqs] == [100, 1100, 2100]
    assert "a" not in sched.requests and bm.kv_cache_usage_perc == 0.0


def test_n_samples_with_a_short_prompt_fork_at_admission() -> None:
    sched = make_scheduler(block_size=4)
    group = sched.add(make_seq("a", 3, n=2, max_tokens=1))
    out, _ = step(sched)
    assert scheduled(out) == {"a/0": 3} and group.seqs[1].status is SequenceStatus.RUNNING
    out, fin = step(sched)
    assert scheduled(out) == {"a/1": 3} and len(fin) == 1
    assert not sched.has_unfinished()


def test_n_samples_need_seats_for_all() -> None:
    sched = make_scheduler(max_num_seqs=3)
    sched.add(make_seq("x", 4, max_tokens=5))
    step(sched)
    sched.add(make_seq("a", 4, n=3))
    out, _ = step(sched)
    assert scheduled(out) == {"x/0": 1}  # 1 + 3 seats would exceed max_num_seqs


def test_abort_group_before_fork() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    group = sched.add(make_seq("a", 20, n=2))
    step(sched)
    assert group.seqs[1].status is SequenceStatus.WAITING
    sched.abort("a")
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in group.seqs)
    assert not sched.has_unfinished() and sched.block_manager.kv_cache_usage_perc == 0.0


def test_explicit_group() -> None:
    base = make_seq("g", 5, max_tokens=2)
    sched = make_scheduler()
    sched.add(SequenceGroup([base, base.spawn(1)]))
    assert len(run_to_completion(sched)) == 2


# ---- everything at once, against a fake KV cache ----


@pytest.mark.parametrize("seed", range(12))
def test_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    chunked = seed % 3 != 2
    sched = make_scheduler(
        num_blocks=rng.choice([12, 24, 64]),
        block_size=rng.choice([2, 4]),
        prefix_caching=seed % 2 == 0,
        max_num_seqs=rng.choice([3, 8]),
        max_num_batched_tokens=rng.choice([8, 32]) if chunked else 32,
        policy=rng.choice(["fcfs", "priority"]),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=rng.choice([None, 6]) if chunked else None,
        max_model_len=None if chunked else 32,
    )
    runner = FakeRunner(sched)
    prefixes = [[rng.randrange(40, 60) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    seqs: list[Sequence] = []
    aborted: set[str] = set()
    for i in range(400):
        if len(seqs) < 40 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(40, 60) for _ in range(rng.randint(0, 8))]
            group = sched.add(
                make_seq(
                    f"r{i}",
                    prompt,
                    priority=rng.randint(0, 3),
                    max_tokens=rng.randint(1, 10),
                    n=rng.choice([1, 1, 2, 3]),
                )
            )
            seqs += group.seqs
        random_step(sched, runner, rng, aborted)
    drain_and_replay(sched, runner, seqs, aborted)
