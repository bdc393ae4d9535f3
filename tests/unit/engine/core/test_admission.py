"""Batching strategies of the scheduler, driven like the scheduler tests: schedule() → made-up sampled
tokens → update(). Continuous stays today's admission; bucketed groups a step's admissions by prompt length;
memory_aware never admits beyond the projected KV blocks."""

from __future__ import annotations

import random

import pytest

from app.engine.core.admission import (
    BATCHING_STRATEGIES,
    BucketedAdmission,
    ContinuousAdmission,
    MemoryAwareAdmission,
)
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence, SequenceStatus
from tests.support.engine_core import (
    FakeRunner,
    drain_and_replay,
    make_scheduler,
    make_seq,
    random_step,
    run_to_completion,
    scheduled,
    step,
)


def admitted(out_scheduled: dict[str, int]) -> list[str]:
    return [name.split("/")[0] for name in out_scheduled]


def test_strategy_config_and_validation() -> None:
    assert SchedulerConfig().batching_strategy == "continuous"
    assert BATCHING_STRATEGIES == ("continuous", "bucketed", "memory_aware")
    kinds = {
        "continuous": ContinuousAdmission,
        "bucketed": BucketedAdmission,
        "memory_aware": MemoryAwareAdmission,
    }
    for name, cls in kinds.items():
        assert type(make_scheduler(batching_strategy=name).admission) is cls
    allowed = "'continuous', 'bucketed', 'memory_aware'"
    with pytest.raises(ValueError, match=f"batching_strategy must be one of {allowed}, got 'greedy'"):
        SchedulerConfig(batching_strategy="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batching_bucket_size must be >= 1"):
        SchedulerConfig(batching_bucket_size=0)


# ---- continuous: today's admission ----


def test_continuous_admits_in_queue_order_whatever_the_lengths() -> None:
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=1024)
    for i, n in enumerate((10, 200, 12, 220, 14)):
        sched.add(make_seq(f"r{i}", n, arrival=float(i)))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r1", "r2", "r3", "r4"]


def test_continuous_stops_at_a_head_that_does_not_fit() -> None:
    # No skipping ahead: the long head waits for room and the short one behind it waits too.
    sched = make_scheduler(
        num_blocks=256, max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16
    )
    sched.add(make_seq("short0", 4, arrival=0.0, max_tokens=8))
    sched.add(make_seq("long", 16, arrival=1.0))
    sched.add(make_seq("short1", 4, arrival=2.0))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["short0"]
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["short0"]  # 1 decode + 16 would exceed the budget of 16


# ---- bucketed ----


def test_bucketed_groups_a_steps_admissions_by_length() -> None:
    sched = make_scheduler(
        num_blocks=256, max_num_batched_tokens=1024, batching_strategy="bucketed", batching_bucket_size=128
    )
    for i, n in enumerate((10, 200, 12, 220, 14)):
        sched.add(make_seq(f"r{i}", n, arrival=float(i)))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r2", "r4"]  # the head's bucket, in queue order
    out, _ = step(sched)
    assert scheduled(out) == {"r0/0": 1, "r2/0": 1, "r4/0": 1, "r1/0": 200, "r3/0": 220}


def test_bucketed_always_admits_the_head_first() -> None:
    # The head is alone in its bucket: it still goes first, and the others wait for the next step.
    sched = make_scheduler(
        num_blocks=256, max_num_batched_tokens=1024, batching_strategy="bucketed", batching_bucket_size=64
    )
    for i, n in enumerate((300, 10, 20, 310)):
        sched.add(make_seq(f"r{i}", n, arrival=float(i)))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r3"]  # 300 // 64 == 310 // 64: skipping ahead within a bucket
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r3", "r1", "r2"]


def test_bucketed_head_then_same_bucket_in_priority_order() -> None:
    sched = make_scheduler(
        num_blocks=256,
        max_num_batched_tokens=1024,
        batching_strategy="bucketed",
        batching_bucket_size=100,
        policy="priority",
    )
    sched.add(make_seq("long-low", 250, priority=5, arrival=0.0))
    sched.add(make_seq("short-low", 30, priority=5, arrival=1.0))
    sched.add(make_seq("long-high", 260, priority=0, arrival=2.0))
    sched.add(make_seq("long-mid", 240, priority=2, arrival=3.0))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["long-high", "long-mid", "long-low"]
    out, _ = step(sched)
    assert admitted(scheduled(out))[-1] == "short-low"


def test_bucketed_skips_sequences_finished_while_waiting() -> None:
    sched = make_scheduler(
        num_blocks=256, max_num_batched_tokens=24, batching_strategy="bucketed", batching_bucket_size=16
    )
    for i in range(4):
        sched.add(make_seq(f"r{i}", 8, arrival=float(i), max_tokens=2))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r1", "r2"]  # budget of 24
    sched.abort("r3")
    assert run_to_completion(sched) and not sched.has_unfinished()


# ---- memory_aware ----


def projected_blocks(sched: Scheduler, seq: Sequence) -> int:
    assert isinstance(sched.admission, MemoryAwareAdmission)
    return sched.admission.projected_blocks(seq)


def test_memory_aware_admits_only_what_its_projection_allows() -> None:
    # 16 blocks of 4 tokens; each request is 8 prompt tokens + 16 outputs = 6 blocks: two fit, not three.
    sched = make_scheduler(num_blocks=16, block_size=4, batching_strategy="memory_aware")
    seqs = [make_seq(f"r{i}", 8, arrival=float(i), max_tokens=16) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r1"]
    while sched.has_unfinished():
        assert sum(projected_blocks(sched, s) for s in sched.running) <= 16
        out, _ = step(sched)
        assert not out.preempted
    assert sched.num_preemptions == 0
    assert all(s.output_token_ids == [100 + i for i in range(16)] for s in seqs)


def test_continuous_preempts_on_the_same_workload() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    for i in range(5):
        sched.add(make_seq(f"r{i}", 8, arrival=float(i), max_tokens=16))
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["r0", "r1", "r2", "r3", "r4"]  # 15 of 16 blocks at once
    run_to_completion(sched)
    assert sched.num_preemptions > 0


def test_memory_aware_admits_a_lone_sequence_beyond_its_projection() -> None:
    # Without max_tokens the projection is the whole maximum length; with nothing running it still goes.
    sched = make_scheduler(num_blocks=4, block_size=4, batching_strategy="memory_aware")
    a, b = make_seq("a", 5, max_tokens=None, arrival=0.0), make_seq("b", 2, max_tokens=1, arrival=1.0)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert admitted(scheduled(out)) == ["a"]  # b would fit today's free blocks, not a's projection
    run_to_completion(sched)
    assert a.status is SequenceStatus.FINISHED_LENGTH and a.num_tokens == 16
    assert b.output_token_ids == [100] and sched.num_preemptions == 0


def test_memory_aware_counts_revived_hits_and_children_to_fork() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, batching_strategy="memory_aware")
    prompt = list(range(1, 10))  # 9 tokens: two full blocks, which stay cached once this one finishes
    sched.add(make_seq("first", prompt, arrival=0.0, max_tokens=3))
    run_to_completion(sched)
    runner = make_seq("runner", 3, arrival=1.0, max_tokens=5)  # 8 tokens: 2 blocks, 1 still to take
    group = sched.add(make_seq("fork", prompt, arrival=2.0, max_tokens=7, n=3))
    sched.add(runner)
    out, _ = step(sched)
    # The fork needs 4 blocks for the parent (2 of them cached hits, taken from the free ones) and 2 more
    # for each child: 1 + 8 > 7 free blocks. Without counting the children or the revived hits it would fit.
    assert admitted(scheduled(out)) == ["runner"]
    run_to_completion(sched)
    assert group.parent.num_cached_tokens == 8
    assert [s.num_output_tokens for s in group.seqs] == [7, 7, 7]
    assert sched.num_preemptions == 0


# ---- all strategies under a random workload, against a fake KV cache ----


@pytest.mark.parametrize("strategy", ["bucketed", "memory_aware"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload(strategy: str, seed: int) -> None:
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=rng.choice([12, 24, 64]),
        block_size=rng.choice([2, 4]),
        prefix_caching=seed % 2 == 0,
        max_num_seqs=rng.choice([3, 8]),
        max_num_batched_tokens=rng.choice([8, 32]),
        policy=rng.choice(["fcfs", "priority"]),
        batching_strategy=strategy,
        batching_bucket_size=rng.choice([4, 8]),
    )
    runner = FakeRunner(sched)
    seqs: list[Sequence] = []
    aborted: set[str] = set()
    for i in range(300):
        if len(seqs) < 40 and rng.random() < 0.3:
            prompt = [rng.randrange(40, 60) for _ in range(rng.randint(1, 20))]
            params = {"max_tokens": rng.randint(1, 10), "n": rng.choice([1, 2])}
            group = sched.add(make_seq(f"r{i}", prompt, priority=rng.randint(0, 3), **params))
            seqs += group.seqs
        random_step(sched, runner, rng, aborted)
    drain_and_replay(sched, runner, seqs, aborted)
