"""``OutputProcessor``: from the tokens a step appended to what callers see (vLLM's ``OutputProcessor``).

After the scheduler has applied a step's sampled tokens, the processor brings each touched sequence's text up
to date (incremental detokenisation), applies stop strings (they may span tokens, so they are found in the
text; a match finishes the sequence through the scheduler's hook and drops tokens that landed after it),
collects logprobs, records request metrics and builds cumulative :class:`RequestOutput` objects. It holds the
per-request state of every unfinished request and knows no model and no tensor: tests drive it with fake
token streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from app.engine.core.sampling_params import SamplingParams
from app.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from app.engine.core.stop_checker import StopChecker, partial_stop_length
from app.engine.metrics import RequestMetrics, StatsCollector
from app.engine.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from app.engine.sampler import SampleResult

__all__ = ["Detokenizer", "DetokenizerFactory", "OutputProcessor", "RequestState", "SeqState"]


class Detokenizer(Protocol):
    """Streaming text from token ids (``app.engine.tokenizer.IncrementalDetokenizer`` is one)."""

    def add(self, token_ids: Seq[int]) -> str: ...

    def flush(self) -> str: ...


class DetokenizerFactory(Protocol):
    """What the processor needs from a tokenizer: one incremental detokenizer per sequence."""

    def incremental_detokenizer(
        self, prompt_ids: Seq[int] = (), skip_special_tokens: bool = True
    ) -> Detokenizer: ...


# The scheduler's hook to finish a sequence (and free its blocks) when a stop string matched.
FinishSequence = Callable[[Sequence, SequenceStatus, str], None]


class SeqState:
    """Detokenisation, stop-string and logprob state of one sequence."""

    __slots__ = ("cumulative_logprob", "detok", "logprobs", "num_detok", "seq", "text", "visible")

    def __init__(
        self, seq: Sequence, detok: Detokenizer, want_logprobs: bool, track_cumulative: bool = False
    ) -> None:
        self.seq = seq
        self.detok = detok
        self.num_detok = 0  # output tokens already fed to the detokenizer
        self.text = ""  # detokenized text (cut at a matched stop string)
        self.visible = 0  # leading characters of ``text`` that are final (no pending stop-string prefix)
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        # Summed when logprobs are asked for, or to rank best_of candidates (then without per-token entries).
        self.cumulative_logprob: float | None = 0.0 if want_logprobs or track_cumulative else None

    def add_logprobs(self, results: Iterable[SampleResult]) -> None:
        """Record the logprobs of newly appended tokens (the sampled one first, then the top alternatives)."""
        if self.cumulative_logprob is None:
            return
        for res in results:
            if res.logprob is None:
                continue
            if self.logprobs is not None:
                entry = {res.token_id: res.logprob}
                if res.top_logprobs:
                    entry.update({k: v for k, v in res.top_logprobs.items() if k != res.token_id})
                self.logprobs.append(entry)
            self.cumulative_logprob += res.logprob

    def completion(self) -> CompletionOutput:
        seq = self.seq
        return CompletionOutput(
            index=seq.index,
            text=self.text[: self.visible],
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )


@dataclass
class RequestState:
    """One unfinished request: its prompt, options, sequences and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    group: SequenceGroup
    states: list[SeqState]
    metrics: RequestMetrics
    stop_checker: StopChecker | None
    by_seq_id: dict[int, SeqState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_seq_id = {st.seq.seq_id: st for st in self.states}

    @property
    def picks_best(self) -> bool:
        """``best_of > n``: the outputs are the ``n`` best candidates, known only when all have finished."""
        return self.params.num_candidates > self.params.n

    def completions(self) -> list[CompletionOutput]:
        """One per sequence; with ``best_of > n`` the ``n`` highest cumulative logprobs (re-indexed 0..n-1,
        best first) once the request finished."""
        outputs = [st.completion() for st in self.states]
        if self.picks_best and self.group.is_finished:
            ranked = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[: self.params.n]
            outputs = [replace(o, index=i) for i, o in enumerate(ranked)]
        return outputs

    def make_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=self.completions(),
            finished=self.group.is_finished,
            metrics=self.metrics.copy(),
            num_cached_tokens=self.metrics.num_cached_tokens,
        )


def _stopped_by_string(seq: Sequence) -> bool:
    return seq.status is SequenceStatus.FINISHED_STOPPED and isinstance(seq.stop_reason, str)


class OutputProcessor:
    """Turns the tokens appended by each step into request outputs; owns every unfinished request's state.

    ``finish_sequence`` is the scheduler's hook (``Scheduler.finish_sequence``) through which a matched stop
    string finishes a sequence; ``stats`` receives first-token, per-step and finished-request metrics.
    """

    def __init__(
        self,
        tokenizer: DetokenizerFactory,
        finish_sequence: FinishSequence,
        stats: StatsCollector | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.finish_sequence = finish_sequence
        self.stats = stats if stats is not None else StatsCollector()
        self.requests: dict[str, RequestState] = {}

    # ---- requests ----
    def __contains__(self, request_id: object) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.requests))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], group: SequenceGroup
    ) -> RequestState:
        """Track a request the scheduler accepted (its options are those of the group's sequences)."""
        params = group.parent.sampling_params
        want_logprobs = params.logprobs is not None
        states = [
            SeqState(
                s,
                self.tokenizer.incremental_detokenizer(prompt_token_ids, params.skip_special_tokens),
                want_logprobs,
                track_cumulative=params.needs_sample_logprob,
            )
            for s in group.seqs
        ]
        stop = params.stop_strings
        req = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            group=group,
            states=states,
            metrics=RequestMetrics(
                arrival_time=group.parent.arrival_time, num_prompt_tokens=len(prompt_token_ids)
            ),
            stop_checker=StopChecker(stop, params.include_stop_str_in_output) if stop else None,
        )
        self.requests[request_id] = req
        return req

    def finish_request(self, request_id: str, now: float | None = None) -> RequestOutput | None:
        """Final output of a request the scheduler already finished or aborted; None if the id is unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, time.monotonic() if now is None else now)

    # ---- one step ----
    def on_scheduled(self, seqs: Iterable[Sequence], now: float) -> None:
        requests = self.requests
        for seq in seqs:
            requests[seq.request_id].metrics.on_scheduled(now)

    def process(
        self,
        seqs: Seq[Sequence],
        results: Seq[Seq[SampleResult]],
        num_output_tokens_before: Seq[int],
        *,
        emit_unfinished: bool = True,
    ) -> list[RequestOutput]:
        """Outputs after a step. ``seqs`` sampled ``results`` (one or more tokens each) and had
        ``num_output_tokens_before`` output tokens before the scheduler applied them. Finished requests are
        always returned (and forgotten); the others that progressed only with ``emit_unfinished`` (offline
        batches skip them, and their per-token detokenisation unless stop strings need it)."""
        now = time.monotonic()
        touched = self._update_sequences(seqs, results, num_output_tokens_before, emit_unfinished)
        return self._make_outputs(touched, now, emit_unfinished)

    def _update_sequences(
        self,
        seqs: Seq[Sequence],
        results: Seq[Seq[SampleResult]],
        before: Seq[int],
        emit_unfinished: bool,
    ) -> dict[str, int]:
        """Text and logprobs of each sequence that got tokens; returns request id -> tokens it got."""
        touched: dict[str, int] = {}
        for seq, seq_results, n0 in zip(seqs, results, before, strict=True):
            if seq.num_output_tokens == n0:
                continue  # finished or aborted before its token was applied
            req = self.requests[seq.request_id]
            st = req.by_seq_id[seq.seq_id]
            # Text is needed now for stop strings, streaming and finished sequences; otherwise it is
            # caught up later in one call (offline batches skip per-token detokenisation). A stop string
            # may drop tokens that landed after it in the same step.
            if req.stop_checker is not None or emit_unfinished or seq.is_finished:
                self._update_text(req, st)
            num_new = seq.num_output_tokens - n0
            st.add_logprobs(seq_results[:num_new])
            touched[req.request_id] = touched.get(req.request_id, 0) + num_new
        return touched

    def _make_outputs(
        self, touched: dict[str, int], now: float, emit_unfinished: bool
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        stats = self.stats
        itls: list[float] = []
        for request_id, count in touched.items():
            req = self.requests[request_id]
            first = req.metrics.first_token_time is None
            itl = req.metrics.on_tokens(now, count)
            if first:
                req.metrics.num_cached_tokens = req.group.parent.num_cached_tokens
                stats.record_first_token(req.metrics)
            elif itl is not None:
                itls.append(itl)
            if req.group.is_finished:
                outputs.append(self._finish(req, now))
            elif emit_unfinished and not req.picks_best:  # best_of > n: the best are not known yet
                outputs.append(req.make_output())
        stats.record_step(sum(touched.values()), itls)
        return outputs

    def _finish(self, req: RequestState, now: float) -> RequestOutput:
        for st in req.states:
            self._update_text(req, st)
            st.visible = len(st.text)
        req.metrics.finished_time = now
        self.stats.record_finished(req.metrics, [st.seq.finish_reason or "abort" for st in req.states])
        del self.requests[req.request_id]
        return req.make_output()

    # ---- text and stop strings ----
    def _update_text(self, req: RequestState, st: SeqState) -> None:
        """Bring ``st.text`` up to the sequence's tokens and apply stop strings."""
        seq = st.seq
        if req.stop_checker is not None:
            # Several tokens can land in one step (speculative decoding). Check stop strings after each, as
            # one-token steps would, so the output ends at the token that completed a stop string.
            while seq.num_output_tokens - st.num_detok > 1 and not _stopped_by_string(seq):
                self._update_text_to(req, st, st.num_detok + 1)
            extra = seq.num_output_tokens - st.num_detok
            if _stopped_by_string(seq) and extra > 0:
                del seq.output_token_ids[-extra:]
                del seq.token_ids[-extra:]
        self._update_text_to(req, st, None)

    def _update_text_to(self, req: RequestState, st: SeqState, upto: int | None) -> None:
        """Detokenize the output up to ``upto`` tokens (None: all of them) and apply stop strings."""
        seq = st.seq
        if _stopped_by_string(seq):
            st.visible = len(st.text)  # cut at its stop string: final (held-back bytes lie beyond it)
            return
        params = req.params
        ids = seq.output_token_ids
        num_output = len(ids) if upto is None else upto
        finished = seq.is_finished and num_output == len(ids)  # (earlier tokens of a finished step: not yet)
        end = num_output
        stopped_by_token = finished and seq.status is SequenceStatus.FINISHED_STOPPED
        if stopped_by_token and not params.include_stop_str_in_output:
            end -= 1  # the eos / stop token id stays in token_ids but not in the text
        delta = ""
        if end > st.num_detok:
            delta = st.detok.add(ids[st.num_detok : end])
            st.num_detok = end
        if finished:
            delta += st.detok.flush()
        if delta:
            st.text += delta
        checker = req.stop_checker
        if checker is None or (not delta and finished):
            st.visible = len(st.text)
            return
        if not delta:
            return
        if num_output >= params.min_tokens:
            found = checker.check(st.text, len(delta))
            st.text = found.text
            if found.stop is not None:
                st.visible = len(st.text)
                self._stop_on_string(seq, found.stop, num_output == len(ids))
                return
            safe = found.safe_len
        else:  # stop strings do not count before min_tokens, but a partial one is still held back
            safe = len(st.text) - (
                0 if params.include_stop_str_in_output else partial_stop_length(st.text, checker.stop)
            )
        st.visible = len(st.text) if finished else max(st.visible, safe)

    def _stop_on_string(self, seq: Sequence, stop: str, at_last_token: bool = True) -> None:
        if seq.status is SequenceStatus.FINISHED_LENGTH or (
            seq.status is SequenceStatus.FINISHED_STOPPED and not at_last_token
        ):
            # Finished by length in the same step (or by a stop token that landed after the stop string in
            # one speculative step): the stop string came first and is what the user sees, so it is the
            # reason reported (as vLLM does). Its blocks are already freed.
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        elif not seq.is_finished:
            self.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, stop)
