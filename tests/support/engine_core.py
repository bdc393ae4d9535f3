"""Driving the scheduler without a model (the engine core's tests): sequences with made-up prompts, steps of
schedule() → made-up sampled tokens → update(), and a fake KV cache that checks every step reads back the right
context."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from app.engine.core.block_manager import BlockManager
from app.engine.core.sampling_params import SamplingParams
from app.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from app.engine.core.sequence import Sequence

EOS = 2
_fresh_tokens = itertools.count(10_000)


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True, **config: Any
) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size, prefix_caching))


def make_seq(
    rid: str,
    prompt: int | list[int],
    *,
    priority: int = 0,
    arrival: float | None = None,
    **params: Any,
) -> Sequence:
    # An int prompt gets tokens no other sequence has, so that no prefix hit happens by accident.
    tokens = [next(_fresh_tokens) for _ in range(prompt)] if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 4)
    return Sequence(
        rid,
        tokens,
        SamplingParams(**params),
        eos_token_id=EOS,
        priority=priority,
        arrival_time=arrival,
    )


def next_token(seq: Sequence) -> int:
    """A fake model: deterministic per sequence and position, never EOS."""
    return 100 + seq.index * 1000 + seq.num_output_tokens


TokenFn = Callable[[Sequence], int]


def step(sched: Scheduler, token: TokenFn = next_token) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    sampled = {s.seq_id: token(s) for s in out.scheduled if out.will_sample(s)}
    return out, sched.update(out, sampled)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        finished += step(sched)[1]
    raise AssertionError("the scheduler did not drain")


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {f"{s.request_id}/{s.index}": out.num_scheduled_tokens[s.seq_id] for s in out.scheduled}


class FakeRunner:
    """Writes, for every computed position, the context it was computed from into its cache slot, and
    checks before each step that a sequence's whole cached context reads back correctly: a block handed
    out while still in use, a wrong prefix hit or a bad fork would show up as a mismatch."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[int, tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput) -> dict[int, int]:
        bm = self.sched.block_manager
        for seq in out.scheduled:
            start, n = seq.num_computed_tokens, out.num_scheduled_tokens[seq.seq_id]
            assert len(seq.block_table) * bm.block_size >= start + n
            for pos, slot in enumerate(bm.slot_mapping(seq, 0, start)):
                assert self.kv.get(slot) == tuple(seq.token_ids[: pos + 1]), f"stale KV for {seq}"
        for seq in out.scheduled:  # writes after all reads: one batched forward
            start, n = seq.num_computed_tokens, out.num_scheduled_tokens[seq.seq_id]
            for pos, slot in zip(
                range(start, start + n), bm.slot_mapping(seq, start, start + n), strict=True
            ):
                self.kv[slot] = tuple(seq.token_ids[: pos + 1])
        return {s.seq_id: fake_token(s) for s in out.scheduled if out.will_sample(s)}


def fake_token(seq: Sequence) -> int:
    return (
        EOS
        if (seq.seq_id * 7 + seq.num_output_tokens) % 23 == 0
        else 30 + (seq.seq_id + seq.num_output_tokens) % 5
    )


def check_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    refs = Counter(b for s in sched.running for b in s.block_table)
    assert [b.ref_count for b in bm.blocks] == [refs[b.block_id] for b in bm.blocks]
    assert bm.num_free_blocks == sum(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_cached_blocks == sum(b.block_hash is not None for b in bm.blocks)
    assert all(not s.block_table for s in sched.waiting)
    assert len(sched.running) <= sched.config.max_num_seqs


def random_step(sched: Scheduler, runner: FakeRunner, rng: random.Random, aborted: set[str]) -> None:
    """One step of a random workload: maybe abort a request, then schedule, run the fake model and check."""
    if sched.requests and rng.random() < 0.03:
        rid = rng.choice(sorted(sched.requests))
        sched.abort(rid)
        aborted.add(rid)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    sched.update(out, runner.run(out))
    check_invariants(sched)


def drain_and_replay(sched: Scheduler, runner: FakeRunner, seqs: list[Sequence], aborted: set[str]) -> None:
    """Run to the end, then check every unaborted sequence holds the fake model's outputs, however it was
    admitted or preempted."""
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.run(out))
        check_invariants(sched)
    assert sched.block_manager.kv_cache_usage_perc == 0.0
    for seq in seqs:
        assert seq.is_finished
        if seq.request_id in aborted:
            continue
        replay = Sequence(seq.request_id, seq.prompt_token_ids)
        replay.seq_id = seq.seq_id
        max_tokens = seq.sampling_params.max_tokens
        while True:
            replay.append_token(fake_token(replay))
            if replay.last_token_id == EOS or replay.num_output_tokens == max_tokens:
                break
            if replay.num_tokens >= sched.max_model_len:
                break
        assert seq.output_token_ids == replay.output_token_ids
