"""OutputProcessor tests on CPU, without a model: each step is the real scheduler's schedule() → made-up
sampled tokens (fake token streams with known text pieces) → update() → OutputProcessor.process()."""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from app.engine.core.block_manager import BlockManager
from app.engine.core.sampling_params import SamplingParams
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from app.engine.output_processor import OutputProcessor
from app.engine.outputs import RequestOutput
from app.engine.sampler import SampleResult

EOS = 2
PROMPT = [1, 3, 4, 5, 6]
# token id -> the text it decodes to
PIECES = {EOS: "</s>", 10: "Hel", 11: "lo", 12: " wo", 13: "rld", 14: "!", 15: "lo wo", 16: " and", 17: " more"}


class FakeDetokenizer:
    """Each token decodes to its piece on its own (no held-back bytes, nothing pending at the end)."""

    def add(self, token_ids: Seq[int]) -> str:
        return "".join(PIECES[t] for t in token_ids)

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    def incremental_detokenizer(
        self, prompt_ids: Seq[int] = (), skip_special_tokens: bool = True
    ) -> FakeDetokenizer:
        return FakeDetokenizer()


class Harness:
    """A scheduler and an output processor wired as LLMEngine wires them, fed by fake token streams."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, **config: Any) -> None:
        self.bm = BlockManager(num_blocks, block_size, True)
        self.scheduler = Scheduler(SchedulerConfig(**config), self.bm)
        self.proc = OutputProcessor(FakeTokenizer(), self.scheduler.finish_sequence)
        self.streams: dict[tuple[str, int], list[int]] = {}

    def add(self, rid: str, stream: list[int] | Mapping[int, list[int]], **params: Any) -> SequenceGroup:
        """Queue request ``rid`` whose sample i will produce ``stream`` (or ``stream[i]``), token by token."""
        seq = Sequence(rid, PROMPT, SamplingParams(**params), eos_token_id=EOS)
        group = SequenceGroup.from_sequence(seq)
        for s in group.seqs:
            self.streams[rid, s.index] = list(stream[s.index] if isinstance(stream, Mapping) else stream)
        self.scheduler.add(group)
        self.proc.add_request(rid, "the prompt", PROMPT, group)
        return group

    def step(self, *, emit_unfinished: bool = True, tokens_per_seq: int = 1) -> list[RequestOutput]:
        """One engine step; a decoding sequence with lookahead slots gets up to ``tokens_per_seq`` tokens at
        once, as speculative decoding would give it."""
        out = self.scheduler.schedule()
        self.proc.on_scheduled(out.scheduled, time.monotonic())
        seqs = [s for s in out.scheduled if out.will_sample(s)]
        results = []
        for s in seqs:
            k = min(tokens_per_seq, 1 + out.num_lookahead_slots.get(s.seq_id, 0))
            stream = self.streams[s.request_id, s.index]
            tokens = stream[s.num_output_tokens : s.num_output_tokens + k]
            results.append([SampleResult(t, -0.5, {t: -0.5, 99: -1.25}) for t in tokens])
        before = [s.num_output_tokens for s in seqs]
        sampled = {s.seq_id: [r.token_id for r in rs] for s, rs in zip(seqs, results, strict=True)}
        self.scheduler.update(out, sampled)
        return self.proc.process(seqs, results, before, emit_unfinished=emit_unfinished)

    def run(self, **kwargs: Any) -> list[list[RequestOutput]]:
        steps = []
        for _ in range(100):
            if not self.proc.has_unfinished_requests():
                return steps
            steps.append(self.step(**kwargs))
        raise AssertionError("the requests did not finish")


def texts(steps: list[list[RequestOutput]], rid: str = "r") -> list[str]:
    return [o.outputs[0].text for outs in steps for o in outs if o.request_id == rid]


def test_text_streams_cumulatively_and_eos_stays_out_of_the_text() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13, EOS], max_tokens=10)
    steps = h.run()
    assert texts(steps) == ["Hel", "Hello", "Hello wo", "Hello world", "Hello world"]
    final = steps[-1][0]
    assert final.finished and final.prompt == "the prompt" and final.prompt_token_ids == PROMPT
    out = final.outputs[0]
    assert out.token_ids == [10, 11, 12, 13, EOS]  # eos in the ids (as vLLM), not in the text
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.logprobs is None and out.cumulative_logprob is None
    assert not h.proc.has_unfinished_requests() and not h.scheduler.has_unfinished()


def test_stop_string_across_token_boundaries_is_held_back_then_cut() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13, 14], stop=["lo wo"], max_tokens=10)
    steps = h.run()
    # "l", then "lo", might start "lo wo": held back until " wo" completes the stop string, which is cut.
    assert texts(steps) == ["He", "Hel", "Hel"]
    out = steps[-1][0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", "lo wo")
    assert out.token_ids == [10, 11, 12]  # nothing was generated after the stop string
    assert h.bm.num_free_blocks == h.bm.num_blocks  # the scheduler freed the sequence's blocks


def test_held_back_text_is_released_when_it_is_not_a_stop_string() -> None:
    h = Harness()
    h.add("r", [10, 11, 14, 16], stop=["lo wo"], max_tokens=4)
    steps = h.run()
    assert texts(steps) == ["He", "Hel", "Hello!", "Hello! and"]
    assert steps[-1][0].outputs[0].finish_reason == "length"


def test_a_partial_stop_string_is_released_when_max_tokens_ends_the_sequence() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13], stop=["lo wo"], max_tokens=2)
    steps = h.run()
    assert texts(steps) == ["He", "Hello"]
    out = steps[-1][0].outputs[0]
    assert (out.finish_reason, out.token_ids) == ("length", [10, 11])


def test_include_stop_str_in_output_keeps_it_and_holds_nothing_back() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13], stop=["lo wo"], include_stop_str_in_output=True, max_tokens=10)
    steps = h.run()
    assert texts(steps) == ["Hel", "Hello", "Hello wo"]
    out = steps[-1][0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", "lo wo", [10, 11, 12])


def test_stop_string_inside_one_token() -> None:
    h = Harness()
    h.add("r", [10, 15, 13], stop=["o w"], max_tokens=10)
    steps = h.run()
    assert texts(steps)[-1] == "Hell"
    assert steps[-1][0].outputs[0].token_ids == [10, 15]


def test_max_tokens_finishes_with_length() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13, 14], max_tokens=3)
    steps = h.run()
    out = steps[-1][0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
        "Hello wo",
        [10, 11, 12],
        "length",
        None,
    )
    assert steps[-1][0].metrics is not None and steps[-1][0].metrics.num_generation_tokens == 3


def test_min_tokens_defers_stop_strings() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 16, 17], stop=[" wo", " more"], min_tokens=4, max_tokens=10)
    out = h.run()[-1][0].outputs[0]
    # " wo" landed before min_tokens and does not count; " more" afterwards does.
    assert (out.text, out.stop_reason, out.token_ids) == ("Hello wo and", " more", [10, 11, 12, 16, 17])


def test_logprobs_one_entry_per_token_sampled_first() -> None:
    h = Harness()
    h.add("r", [10, 11, EOS], logprobs=1, max_tokens=10)
    out = h.run()[-1][0].outputs[0]
    assert out.logprobs == [{10: -0.5, 99: -1.25}, {11: -0.5, 99: -1.25}, {EOS: -0.5, 99: -1.25}]
    assert list(out.logprobs[0]) == [10, 99]  # the sampled token first
    assert out.cumulative_logprob == pytest.approx(-1.5)


def test_logprobs_stop_at_a_stop_string() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13], stop=["lo wo"], logprobs=0, max_tokens=10)
    out = h.run()[-1][0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 3


def test_n_samples_each_with_its_own_text_and_finish() -> None:
    h = Harness()
    h.add("r", {0: [10, 11, 12, 13], 1: [14, 16, 17, 13]}, n=2, stop=[" and"], max_tokens=4)
    steps = h.run()
    final = steps[-1][0]
    assert final.finished and [o.index for o in final.outputs] == [0, 1]
    first, second = final.outputs
    assert (first.text, first.finish_reason) == ("Hello world", "length")
    assert (second.text, second.finish_reason, second.stop_reason) == ("!", "stop", " and")
    assert second.token_ids == [14, 16]
    # Unfinished while either sample runs: the earlier outputs all say so.
    assert all(not o.finished for outs in steps[:-1] for o in outs)


def test_offline_mode_returns_only_finished_requests_with_their_whole_text() -> None:
    h = Harness()
    h.add("a", [10, 11, 12, 13, EOS], max_tokens=10)
    h.add("b", [14, 16, 17], max_tokens=2)
    steps = h.run(emit_unfinished=False)
    finished = [o for outs in steps for o in outs]
    assert [(o.request_id, o.text, o.outputs[0].finish_reason) for o in finished] == [
        ("b", "! and", "length"),
        ("a", "Hello world", "stop"),
    ]


def test_several_tokens_in_one_step_end_at_the_stop_string() -> None:
    # Speculative decoding: a step may append several tokens; the output ends at the one that completed a
    # stop string, and the tokens after it are dropped.
    h = Harness(num_lookahead_slots=3)
    h.add("r", [10, 11, 12, 13, 14, 16], stop=["lo wo"], max_tokens=10)
    steps = h.run(tokens_per_seq=4)
    assert len(steps) == 2  # the prefill's token, then four at once
    out = steps[-1][0].outputs[0]
    assert (out.text, out.token_ids, out.stop_reason) == ("Hel", [10, 11, 12], "lo wo")
    assert h.bm.num_free_blocks == h.bm.num_blocks  # all blocks back once the stop string finished it


def test_abort_returns_the_text_so_far() -> None:
    h = Harness()
    h.add("r", [10, 11, 12, 13], stop=["lo wo"], max_tokens=10)
    h.step()
    h.step()
    assert h.scheduler.abort("r")
    out = h.proc.finish_request("r")
    assert out is not None and out.finished
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("Hello", "abort")  # nothing held back now
    assert h.proc.finish_request("r") is None and "r" not in h.proc


def test_stop_string_and_length_in_the_same_step_report_the_stop_string() -> None:
    h = Harness()
    group = h.add("r", [10, 11, 12], stop=["lo wo"], max_tokens=3)
    out = h.run()[-1][0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", "lo wo", "Hel")
    assert group.parent.status is SequenceStatus.FINISHED_STOPPED
