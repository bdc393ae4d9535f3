"""Speculative decoding: cheap guesses of the next tokens, verified by the target model in one pass.

For each decoding sequence the scheduler reserves ``k`` lookahead slots. A *proposer* guesses up to ``k``
tokens: :class:`NgramProposer` copies what followed the latest earlier occurrence of the sequence's last
n-gram (prompt lookup), :class:`DraftModelProposer` runs a smaller model (or the same one) autoregressively.
The target model then computes the last real token and all proposals in ONE forward pass per step, which
yields ``k + 1`` next-token distributions at once, and :func:`verify` decides what to keep:

* proposal ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, where ``p_j`` is exactly the
  distribution the sampler would draw from at that position (every sampling option applied, for the history
  that includes the earlier proposals) and ``q_j`` the one the proposal was drawn from (one-hot for n-grams
  and for greedy requests);
* at the first rejection the model's own token is drawn from ``normalise(max(0, p_j - q_j))``; when every
  proposal is accepted, a bonus token is drawn from ``p_k``.

This is standard speculative rejection sampling: every emitted token follows the target distribution
exactly. For greedy requests ``p_j`` is one-hot at the argmax, so a proposal is kept iff it equals the
token plain decoding would pick, and the output is the same token for token.

The cache slots of rejected proposals hold garbage past the sequence's length; they are overwritten when
those positions are computed for real, and blocks that only they used go back to the pool.

Guided decoding (structured outputs): speculation is off for constrained sequences (the scheduler gives them
no lookahead slots) and they decode one token per step, masked by their grammar, in the same batch as the
speculating ones. Exact verification would need ``p_j`` masked by the grammar state *after* the earlier
proposals: advancing each matcher through its ``k`` proposals to fill ``k + 1`` masks per row per step (the
mask fill is the grammar's main per-token cost), rolling back the rejected suffix, and for a draft model
masking ``q`` too, while proposals drawn without the grammar (n-gram lookup in the prompt, an unmasked draft)
mostly break it at once and would be rejected anyway.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from app.engine.core.scheduler import SchedulerOutput
from app.engine.core.sequence import Sequence
from app.engine.sampler import Sampler, SampleResult, SamplingRow, seeded_uniform

if TYPE_CHECKING:
    from collections.abc import Callable

    from app.engine.guided.bitmask import TokenBitmask
    from app.engine.model_runner import ModelRunner
    from app.engine.models.base import PagedCausalLM

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "Proposal",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "SpeculativeDecoder",
    "verify",
]

SPEC_METHODS = ("ngram", "draft_model")
_METHOD_ALIASES = {"ngram": "ngram", "[ngram]": "ngram", "draft_model": "draft_model", "draft": "draft_model"}

# Seeded requests draw their uniforms from seeded_uniform(seed, index, position, draw); the sampler uses draw
# numbers 0..64 (top-p rounds), so speculation takes its own streams far above them.
_DRAW_ACCEPT = 1 << 20
_DRAW_FINAL = (1 << 20) + 1
_DRAW_PROPOSE = (1 << 20) + 2


# ---- configuration ---------------------------------------------------------------------------------------


@dataclass
class SpeculativeConfig:
    """How to speculate; vLLM's ``speculative_config`` keys.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``, or
    ``{"method": "draft_model", "model": PATH_OR_LOADED_MODEL, "num_speculative_tokens": 4}``. The draft model
    must share the target's tokenizer (its vocabulary may be smaller, never larger). With a ``model`` and no
    ``method``, the method is ``draft_model``.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    # n-gram: the longest and shortest suffix looked up (one given: both that value; none: 4 and 1)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: an HF folder, a .gguf file, or an already loaded engine model (the target itself works)
    model: str | Path | PagedCausalLM | None = None
    # No proposals while this many sequences or more are running (big batches are compute-bound already).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError(
                    "speculative_config needs a 'method': 'ngram', or 'draft_model' with a 'model'"
                )
            method = "draft_model"
        resolved = _METHOD_ALIASES.get(str(method))
        if resolved is None:
            raise ValueError(f"speculative method {method!r} is not supported; use one of {SPEC_METHODS}")
        self.method = resolved
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 or None, got {self.disable_by_batch_size}")
        if resolved == "ngram":
            if self.model is not None:
                raise ValueError("the ngram method takes no 'model'; use method 'draft_model' for a draft")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo, hi = 1, 4
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            assert lo is not None and hi is not None
            if lo < 1 or hi < lo:
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.model is None:
            raise ValueError("the draft_model method needs a 'model' (a path or a loaded model)")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict, or a JSON object string (the ``INF_ENGINE_SPECULATIVE_CONFIG``
        form); None, ``""`` and ``{}`` mean no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config must be a dict or a JSON object, got {type(value).__name__}"
            )
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(value))

    def describe(self) -> dict[str, Any]:
        """The settings as plain values (a loaded model shows as its name)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        model = out["model"]
        if model is not None and not isinstance(model, str | Path):
            out["model"] = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
        elif isinstance(model, Path):
            out["model"] = str(model)
        return out


# ---- statistics ------------------------------------------------------------------------------------------


@dataclass
class SpecDecodeStats:
    """Cumulative counters, named like vLLM's ``vllm:spec_decode_*`` metrics."""

    num_drafts: int = 0  # sequence-steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # accepted, by proposal position

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: accepted proposals plus the model's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_proposed: Seq[int], num_accepted: Seq[int]) -> None:
        for k, a in zip(num_proposed, num_accepted, strict=True):
            if k == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            per_pos = self.num_accepted_tokens_per_pos
            if len(per_pos) < k:
                per_pos.extend([0] * (k - len(per_pos)))
            for j in range(a):
                per_pos[j] += 1

    def copy(self) -> SpecDecodeStats:
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))


# ---- proposals -------------------------------------------------------------------------------------------


@dataclass
class Proposal:
    """Proposed tokens for one sequence; ``probs[j]`` is the distribution ``tokens[j]`` was drawn from, or
    None when every proposal was deterministic (one-hot q: n-grams, greedy requests)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n`` tokens (longest ``n``
    first, from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed it.
    When the occurrence is so recent that fewer than ``k`` tokens follow it, the text is periodic and the
    proposal continues the period.

    Free to compute and strong on text that repeats its context (extraction, code edits, summaries that
    quote). The search runs in C: the ids are packed as 8-byte integers and searched with ``bytes.rfind``.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    @staticmethod
    def _continue(token_ids: Seq[int], start: int, k: int) -> list[int]:
        """The ``k`` tokens from ``start`` on, copying on into the proposal itself when they run past the end
        (an occurrence close to the end means the text repeats with that period, LZ77-style)."""
        length = len(token_ids)
        out = list(token_ids[start : start + k])
        while len(out) < k:
            out.append(out[start + len(out) - length])
        return out

    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
        length = len(token_ids)
        if k < 1 or length < self.min_n + 1:
            return []
        data = array("q", token_ids).tobytes()
        width = 8
        # An occurrence must end before the last token, so that at least one token follows it.
        limit = (length - 1) * width
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = data[(length - n) * width :]
            end = limit
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % width == 0:  # a match at a token boundary, not across the bytes of two ids
                    return self._continue(token_ids, at // width + n, k)
                end = at + len(suffix) - 1  # keep looking to the left of this misaligned match
        return []


class _SeqView:
    """A sequence as :meth:`ModelRunner.prepare` should see it: proposals appended to its tokens and/or
    another computed count (the draft model's progress). Anything else is read from the real sequence."""

    __slots__ = ("_seq", "num_computed_tokens", "token_ids")

    def __init__(self, seq: Sequence, token_ids: list[int], num_computed_tokens: int) -> None:
        self._seq = seq
        self.token_ids = token_ids
        self.num_computed_tokens = num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seq, name)


def _run_rows(
    runner: ModelRunner, items: list[tuple[Sequence | _SeqView, int]], sample_rows: list[int]
) -> torch.Tensor:
    """One forward pass over ``(sequence or view, tokens to compute)`` items; logits of the given flat rows."""
    step = SchedulerOutput(
        scheduled=[cast(Sequence, seq) for seq, _ in items],
        num_scheduled_tokens={seq.seq_id: n for seq, n in items},
    )
    t0 = time.perf_counter()
    batch = runner.prepare(step)
    index = torch.tensor(sample_rows, dtype=torch.long).to(runner.device, non_blocking=True)
    batch = replace(batch, sample_index=index, sampling_seqs=[])
    t1 = time.perf_counter()
    logits = runner.run(batch)
    tm = runner.timings
    tm.prepare_s += t1 - t0
    tm.forward_s += time.perf_counter() - t1
    tm.num_steps += 1
    tm.num_tokens += batch.attn.num_tokens
    return logits


def _row_for(seq: Sequence, extra: Seq[int]) -> SamplingRow:
    """The sampling row of ``seq`` as if ``extra`` tokens had already been generated after its output."""
    return SamplingRow(
        params=seq.sampling_params,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=[*seq.output_token_ids, *extra] if extra else seq.output_token_ids,
        seq_index=seq.index,
        eos_token_id=seq.eos_token_id,
    )


class _Uniforms:
    """Uniforms for speculative draws: counter-based for seeded requests (the same whatever the batch),
    from one generator for the others."""

    def __init__(self, seed: int | None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed ^ 0x5EED5EED)

    def draw(self, items: Seq[tuple[Sequence, int]], stream: int) -> torch.Tensor:
        """One float64 uniform per ``(sequence, output position)``."""
        fresh = torch.rand(len(items), dtype=torch.float64, generator=self.generator).tolist()
        values = [
            seeded_uniform(seed, seq.index, position, stream)
            if (seed := seq.sampling_params.seed) is not None
            else u
            for (seq, position), u in zip(items, fresh, strict=True)
        ]
        return torch.tensor(values, dtype=torch.float64)


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative (unnormalised) ``probs`` by inverse CDF with uniforms ``u``; never
    a zero-probability token."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    found = torch.searchsorted(cdf, u.to(cdf.device).unsqueeze(1) * total, right=True)
    last = torch.searchsorted(cdf, total.contiguous(), right=False)  # the last token with mass
    return torch.minimum(found, last).squeeze(1)


class DraftModelProposer:
    """Proposals from a draft model that runs autoregressively over its own KV cache.

    The draft cache has the target's block layout (same number of blocks, same block size) and follows the
    target's block tables, so it needs no allocator of its own: the draft writes its KV for position ``p``
    of a sequence into the slot where the target keeps that position. Its progress per sequence is tracked
    here; a sequence seen for the first time (or again after a preemption, which gave it new blocks) is
    caught up by one draft prefill. Proposals are drawn from the draft's distribution under the request's
    own sampling options (greedy requests: its argmax), so a draft equal to the target is always accepted.
    """

    def __init__(
        self,
        model: PagedCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        from app.engine.model_runner import ModelRunner

        draft_vocab = model.config.vocab_size
        if draft_vocab > target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab}) is larger than the target's "
                f"({target_vocab_size}): the draft must use the target's tokenizer"
            )
        self.model = model
        self.vocab_size = target_vocab_size
        self.sampler = sampler
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device
        )
        # seq id -> (sequence, its num_preemptions when recorded, tokens whose draft KV is in the cache)
        self._progress: dict[int, tuple[Sequence, int, int]] = {}

    @classmethod
    def from_config(
        cls,
        spec: SpeculativeConfig,
        *,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
        cache_dir: str | Path | None = None,
    ) -> DraftModelProposer:
        """The proposer of a ``draft_model`` config: its ``model`` loaded when it is a path (or used as
        given), checked to cover the target's ``max_model_len``."""
        from app.engine.models.base import PagedCausalLM

        draft_model = spec.model
        if isinstance(draft_model, str | Path):
            from app.engine.loading import load_model  # deferred: pulls in settings and safetensors

            draft_model, _, _ = load_model(draft_model, dtype=dtype, device=device, cache_dir=cache_dir)
        if not isinstance(draft_model, PagedCausalLM):
            raise ValueError(
                "speculative_config 'model' must be a path or a loaded engine model (PagedCausalLM), "
                f"got {type(draft_model).__name__}"
            )
        draft_len = draft_model.config.max_position_embeddings
        if draft_len < max_model_len:
            raise ValueError(
                f"the draft model's context ({draft_len}) is shorter than max_model_len "
                f"({max_model_len}); set max_model_len <= {draft_len}"
            )
        return cls(
            draft_model,
            num_blocks=num_blocks,
            block_size=block_size,
            target_vocab_size=target_vocab_size,
            dtype=dtype,
            device=device,
            sampler=sampler,
        )

    def _computed(self, seq: Sequence) -> int:
        entry = self._progress.get(seq.seq_id)
        if entry is None or entry[1] != seq.num_preemptions:
            return 0
        return min(entry[2], seq.num_tokens - 1)

    def propose(self, requests: list[tuple[Sequence, int]], uniforms: _Uniforms) -> list[Proposal]:
        """Up to ``k`` proposals for each ``(sequence, k)``, batched: one catch-up pass that ends on each
        sequence's last token, then one single-token pass per further proposal."""
        self._forget_finished()
        proposals = [Proposal([]) for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, (_, k) in enumerate(requests) if k > 0]
        step = 0
        while active:
            items: list[tuple[Sequence | _SeqView, int]] = []
            rows: list[int] = []
            total = 0
            for i in active:
                seq, _ = requests[i]
                drafted = proposals[i].tokens
                if step == 0:
                    start = self._computed(seq)
                    view = _SeqView(seq, seq.token_ids, start)
                    n = seq.num_tokens - start
                else:
                    view = _SeqView(seq, [*seq.token_ids, *drafted], seq.num_tokens + step - 1)
                    n = 1
                items.append((view, n))
                total += n
                rows.append(total - 1)
            logits = _run_rows(self.runner, items, rows)
            if logits.shape[1] < self.vocab_size:  # a smaller draft vocabulary: the rest has no mass
                logits = torch.nn.functional.pad(
                    logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf")
                )
            sampling_rows = [_row_for(requests[i][0], proposals[i].tokens) for i in active]
            q = self.sampler.target_probs(logits, sampling_rows)
            u = uniforms.draw(
                [(requests[i][0], requests[i][0].num_output_tokens + step) for i in active], _DRAW_PROPOSE
            )
            tokens = _invert_cdf(q, u).tolist()
            for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                proposals[i].tokens.append(int(token))
                if not requests[i][0].sampling_params.is_greedy:
                    q_rows[i].append(q[row])
            step += 1
            active = [i for i in active if requests[i][1] > step]
        for i, (seq, _) in enumerate(requests):
            if q_rows[i]:
                proposals[i].probs = torch.stack(q_rows[i])
            if requests[i][1] > 0:  # its catch-up pass covered every real token
                self._progress[seq.seq_id] = (seq, seq.num_preemptions, seq.num_tokens)
        return proposals

    def accepted(self, seq: Sequence, num_tokens_before: int, num_proposed: int, num_accepted: int) -> None:
        """After verification: the draft also holds KV for the proposals it fed back that were accepted
        (all but the last proposal were fed back)."""
        entry = self._progress.get(seq.seq_id)
        if entry is not None and num_proposed > 0:
            self._progress[seq.seq_id] = (
                seq,
                entry[1],
                num_tokens_before + min(num_accepted, num_proposed - 1),
            )

    def _forget_finished(self) -> None:
        done = [sid for sid, (seq, _, _) in self._progress.items() if seq.is_finished]
        for sid in done:
            del self._progress[sid]


# ---- verification ----------------------------------------------------------------------------------------


def verify(
    target_probs: torch.Tensor,
    proposals: Seq[Proposal],
    u_accept: torch.Tensor,
    u_final: torch.Tensor,
) -> tuple[list[int], list[int]]:
    """Speculative rejection sampling over a batch.

    ``target_probs`` holds ``k_i + 1`` rows per proposal ``i`` (its ``k_i`` tokens, then the bonus position),
    proposal after proposal. ``u_accept`` has one uniform per proposed token (same order), ``u_final`` one per
    target row, of which the row where the final token is drawn uses its own: so a seeded request's draw for
    an output position is tied to that position, never reused for another. Returns, per proposal, the
    number of accepted tokens ``a_i`` and the token drawn after them (from the residual ``max(0, p - q)`` at
    a rejection, from ``p`` when all were accepted).
    """
    device = target_probs.device
    starts: list[int] = []
    draft_rows: list[int] = []
    draft_tokens: list[int] = []
    offset = 0
    for prop in proposals:
        starts.append(offset)
        k = len(prop.tokens)
        draft_rows.extend(range(offset, offset + k))
        draft_tokens.extend(prop.tokens)
        offset += k + 1
    if offset != target_probs.shape[0] or offset != u_final.shape[0]:
        raise ValueError(
            f"{target_probs.shape[0]} target rows and {u_final.shape[0]} final uniforms for proposals that "
            f"need {offset}"
        )
    accepted_flags: list[bool] = []
    if draft_rows:
        rows_t = torch.tensor(draft_rows, dtype=torch.long, device=device)
        tokens_t = torch.tensor(draft_tokens, dtype=torch.long, device=device)
        p_d = target_probs[rows_t, tokens_t].to(torch.float64)
        q_d = torch.ones_like(p_d)
        at = 0
        for prop in proposals:
            k = len(prop.tokens)
            if prop.probs is not None and k:
                own = torch.tensor(prop.tokens, dtype=torch.long, device=prop.probs.device)
                q_d[at : at + k] = prop.probs[torch.arange(k, device=own.device), own].to(
                    device, torch.float64
                )
            at += k
        # u < p / q, written without the division (q > 0: a proposal is never a zero-probability draw).
        accepted_flags = (u_accept.to(device) * q_d < p_d).tolist()
    num_accepted: list[int] = []
    at = 0
    for prop in proposals:
        k = len(prop.tokens)
        a = 0
        while a < k and accepted_flags[at + a]:
            a += 1
        num_accepted.append(a)
        at += k
    final_rows = torch.tensor([s + a for s, a in zip(starts, num_accepted, strict=True)], device=device)
    final = target_probs.index_select(0, final_rows).clone()
    for i, (prop, a) in enumerate(zip(proposals, num_accepted, strict=True)):
        if a == len(prop.tokens):
            continue  # all accepted: the bonus token comes from p itself
        if prop.probs is None:
            final[i, prop.tokens[a]] = 0.0  # max(0, p - onehot(d)): p without the rejected token
        else:
            final[i] = (final[i] - prop.probs[a].to(device)).clamp_min_(0.0)
    # A residual that rounds to nothing (p and q all but equal) means any draw from p is right.
    empty = final.sum(dim=-1) <= 0
    if bool(empty.any()):
        final[empty] = target_probs.index_select(0, final_rows)[empty]
    tokens = _invert_cdf(final, u_final.index_select(0, final_rows.cpu())).tolist()
    return num_accepted, [int(t) for t in tokens]


# ---- the step --------------------------------------------------------------------------------------------


class SpeculativeDecoder:
    """Runs engine steps that carry lookahead slots: propose, verify in one target pass, report."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        sampler: Sampler,
        *,
        vocab_size: int,
        draft: DraftModelProposer | None = None,
        seed: int | None = None,
    ) -> None:
        if config.method == "draft_model" and draft is None:
            raise ValueError("the draft_model method needs a DraftModelProposer")
        self.config = config
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.draft = draft
        self.ngram = (
            NgramProposer(config.prompt_lookup_min or 1, config.prompt_lookup_max or 1)
            if config.method == "ngram"
            else None
        )
        self.uniforms = _Uniforms(seed)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.propose_s = 0.0  # time spent proposing (the draft model's passes), for benchmarks
        # Grammar masks for the rows sampled one token at a time (the engine's guided decoding), or None.
        self.guide: Callable[[Seq[Sequence]], TokenBitmask | None] | None = None

    def _mask(self, seqs: Seq[Sequence]) -> TokenBitmask | None:
        return self.guide(seqs) if self.guide is not None and seqs else None

    def _propose(self, requests: list[tuple[Sequence, int]]) -> list[Proposal]:
        t0 = time.perf_counter()
        if self.draft is not None:
            proposals = self.draft.propose(requests, self.uniforms)
        else:
            assert self.ngram is not None
            proposals = [Proposal(self.ngram.propose(seq.token_ids, k)) for seq, k in requests]
        self.propose_s += time.perf_counter() - t0
        return proposals

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[list[SampleResult]]]:
        """Run one scheduled step; returns the sequences that produced tokens and, for each, its tokens in
        order (accepted proposals, then the model's own token) with their logprobs when asked for."""
        requests = [
            (seq, out.num_lookahead_slots[seq.seq_id])
            for seq in out.scheduled
            if out.num_lookahead_slots.get(seq.seq_id, 0) > 0
        ]
        by_id = {
            seq.seq_id: prop
            for (seq, _), prop in zip(requests, self._propose(requests), strict=True)
            if prop.tokens
        }
        if not by_id:  # nothing to verify (no n-gram matched): an ordinary step
            plain_logits, plain_seqs = self.runner.execute(out)
            rows = [SamplingRow.from_sequence(s) for s in plain_seqs]
            if not plain_seqs:
                return plain_seqs, []
            return plain_seqs, [[r] for r in self.sampler.sample(plain_logits, rows, self._mask(plain_seqs))]

        # One target pass: every scheduled sequence with its proposals appended.
        items: list[tuple[Sequence | _SeqView, int]] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        total = 0
        for seq in out.scheduled:
            n = out.num_scheduled_tokens[seq.seq_id]
            prop = by_id.get(seq.seq_id)
            k = len(prop.tokens) if prop is not None else 0
            samples = seq.num_computed_tokens + n == seq.num_tokens
            if prop is not None and k:
                view = _SeqView(seq, [*seq.token_ids, *prop.tokens], seq.num_computed_tokens)
                items.append((view, n + k))
            else:
                items.append((seq, n))
            total += n + k
            if samples:
                sample_rows.extend(range(total - k - 1, total))
                sampling_seqs.append(seq)
        logits = _run_rows(self.runner, items, sample_rows)

        plain: list[int] = []  # indices into sampling_seqs: an ordinary one-token sample
        spec: list[int] = []
        row_of: list[int] = []  # first logits row of each sampling sequence
        row = 0
        for i, seq in enumerate(sampling_seqs):
            prop = by_id.get(seq.seq_id)
            row_of.append(row)
            if prop is not None and prop.tokens:
                spec.append(i)
                row += len(prop.tokens) + 1
            else:
                plain.append(i)
                row += 1
        results: list[list[SampleResult]] = [[] for _ in sampling_seqs]
        if plain:
            index = torch.tensor([row_of[i] for i in plain], dtype=torch.long, device=logits.device)
            plain_seqs = [sampling_seqs[i] for i in plain]
            plain_results = self.sampler.sample(
                logits.index_select(0, index),
                [SamplingRow.from_sequence(seq) for seq in plain_seqs],
                self._mask(plain_seqs),
            )
            for i, res in zip(plain, plain_results, strict=True):
                results[i] = [res]
        if spec:
            self._verify(
                logits, [sampling_seqs[i] for i in spec], [row_of[i] for i in spec], by_id, results, spec
            )
        return sampling_seqs, results

    def _verify(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        first_rows: list[int],
        by_id: dict[int, Proposal],
        results: list[list[SampleResult]],
        slots: list[int],
    ) -> None:
        proposals = [by_id[s.seq_id] for s in seqs]
        rows_index: list[int] = []
        sampling_rows: list[SamplingRow] = []
        accept_draws: list[tuple[Sequence, int]] = []
        final_draws: list[tuple[Sequence, int]] = []
        for seq, prop, first in zip(seqs, proposals, first_rows, strict=True):
            k = len(prop.tokens)
            rows_index.extend(range(first, first + k + 1))
            sampling_rows.extend(_row_for(seq, prop.tokens[:j]) for j in range(k + 1))
            accept_draws.extend((seq, seq.num_output_tokens + j) for j in range(k))
            final_draws.extend((seq, seq.num_output_tokens + j) for j in range(k + 1))
        index = torch.tensor(rows_index, dtype=torch.long, device=logits.device)
        spec_logits = logits.index_select(0, index)
        probs = self.sampler.target_probs(spec_logits, sampling_rows)
        num_accepted, final = verify(
            probs,
            proposals,
            self.uniforms.draw(accept_draws, _DRAW_ACCEPT),
            self.uniforms.draw(final_draws, _DRAW_FINAL),
        )
        self.stats.record([len(p.tokens) for p in proposals], num_accepted)

        # The emitted tokens, with logprobs from the rows that predicted them when a request wants them.
        emitted: list[list[int]] = []
        score_rows: list[int] = []
        score_sampling: list[SamplingRow] = []
        score_tokens: list[int] = []
        offset = 0
        for seq, prop, a, token in zip(seqs, proposals, num_accepted, final, strict=True):
            tokens = [*prop.tokens[:a], token]
            emitted.append(tokens)
            if seq.sampling_params.needs_sample_logprob:
                score_rows.extend(range(offset, offset + a + 1))
                score_sampling.extend(sampling_rows[offset : offset + a + 1])
                score_tokens.extend(tokens)
            offset += len(prop.tokens) + 1
            if self.draft is not None:
                self.draft.accepted(seq, seq.num_tokens, len(prop.tokens), a)
        scored = iter(
            self.sampler.score(
                spec_logits.index_select(0, torch.tensor(score_rows, dtype=torch.long, device=logits.device)),
                score_sampling,
                score_tokens,
            )
            if score_rows
            else []
        )
        for slot, seq, tokens in zip(slots, seqs, emitted, strict=True):
            if seq.sampling_params.needs_sample_logprob:
                results[slot] = [next(scored) for _ in tokens]
            else:
                results[slot] = [SampleResult(t) for t in tokens]
