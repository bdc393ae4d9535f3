"""Next-token sampling for a whole batch in one batched pass over a ``[B, V]`` logits tensor.

Processing order (the same as vLLM's V1 sampler, so that requests behave alike on both engines):

1. ``logit_bias`` is added.
2. Penalties: repetition (prompt + output tokens, HF/vLLM semantics), then frequency and presence (output
   tokens only, OpenAI semantics).
3. ``min_tokens``: eos and ``stop_token_ids`` are masked to ``-inf`` while too few tokens were generated.
   Guided decoding: the grammar's allowed-token bitmask sets every other token of the constrained rows to
   ``-inf``, in one batched pass (``app.engine.guided.bitmask``); those rows skip the ``min_tokens`` mask,
   as the grammar alone decides when the output may end.
4. Greedy rows (temperature ~ 0) take the argmax here: nothing random touches them.
5. Sampled rows: divide by temperature, mask by ``min_p``, then ``top_k``, then ``top_p`` (on the
   distribution left by the previous masks), then draw.

How a token is drawn, and why it is neither ``torch.multinomial`` nor the exponential race
(``argmax(p / Exp(1))``): both spend one random number per vocabulary entry, and on this CPU generating
``64 x 49,152`` exponentials costs ~150 ms, more than everything else together. We draw *one* uniform per
row and invert the row's CDF (two-level: block masses, then one block; see
:func:`app.engine.sampling_ops.invert_cdf`, which speculative decoding draws with too).

``top_p`` is not done by sorting (a full sort of ``64 x 49,152`` floats costs ~0.6 s here) but by
rejection: draw from the top-k/min-p distribution; the token is inside the nucleus iff the mass of strictly
more probable tokens is below ``top_p``, a single ``O(V)`` test; when it is not, every token at most as
probable is outside too, so we redraw among the strictly more probable ones. The accepted token follows
exactly the renormalised nucleus distribution, and typically one round suffices.

Seeded rows get their uniforms from a counter-based hash of ``(seed, seq_index, output position, round)``,
so a seeded request draws the same tokens whatever else is in the batch, after preemption and recompute,
and ``n > 1`` siblings (different ``seq_index``) differ. Every tensor operation used is row-independent,
which is what makes the token depend only on the row's own logits and uniforms.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from app.engine.core.sampling_params import SamplingParams
from app.engine.guided.bitmask import TokenBitmask, apply_bitmask
from app.engine.kernels.elementwise import argmax_rows
from app.engine.sampling_ops import block_mass, invert_cdf, pad_to_cdf_blocks

if TYPE_CHECKING:
    from app.engine.core.sequence import Sequence

__all__ = [
    "LogprobsMode",
    "SampleResult",
    "Sampler",
    "SamplingRow",
    "check_params_for_vocab",
    "seeded_uniform",
]

# "raw": log_softmax of the model's logits (vLLM's default); "processed": after logit_bias, penalties,
# min_tokens masking and temperature, before the top-k/top-p/min-p truncation.
LogprobsMode = Literal["raw", "processed"]

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits batch."""

    params: SamplingParams
    prompt_token_ids: SequenceOf[int]
    output_token_ids: SequenceOf[int]
    seq_index: int = 0  # which of the request's n samples; mixed into the seed so siblings differ
    eos_token_id: int | None = None  # masked while fewer than min_tokens were generated (unless ignore_eos)

    @classmethod
    def from_sequence(cls, seq: Sequence) -> SamplingRow:
        return cls(
            params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            seq_index=seq.index,
            eos_token_id=seq.eos_token_id,
        )


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One row's sampled token. ``logprob``/``top_logprobs`` are None unless the request asked for logprobs.

    ``top_logprobs`` maps the ``params.logprobs`` most probable token ids to their logprobs, most probable
    first (dict order); it is empty for ``logprobs=0``.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def check_params_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids the model cannot produce; for the engine to call when a request is added.

    The sampler itself silently ignores out-of-range ids instead of raising, because an exception inside a
    batched step would fail every request in the batch, not only the faulty one.
    """
    for token_id in params.logit_bias or {}:
        if token_id >= vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})")
    for token_id in params.stop_token_ids or ():
        if token_id >= vocab_size:
            raise ValueError(f"stop_token_ids entry {token_id} is outside the vocabulary (size {vocab_size})")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, seq_index: int, position: int, draw: int = 0) -> float:
    """A uniform in [0, 1) that depends only on its arguments (a counter-based RNG).

    Stateless on purpose: no generator has to be stored per sequence, kept in sync across preemption, or
    created per step, and the value is the same on CPU and CUDA.
    """
    h = _splitmix64(seed & _MASK64)
    for value in (seq_index, position, draw):
        h = _splitmix64(h ^ (value & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))  # top 53 bits: every double in [0, 1) this can give is exact


class _Plan:
    """The batch's per-row options flattened into lists, gathered in one Python pass over the rows."""

    def __init__(
        self, rows: SequenceOf[SamplingRow], vocab_size: int, guide: TokenBitmask | None = None
    ) -> None:
        self.guide = guide if guide is not None and guide.rows else None
        constrained = frozenset(self.guide.rows) if self.guide is not None else frozenset()
        self.greedy: list[int] = []
        self.sampled: list[int] = []
        self.temperature: list[float] = []  # per sampled row
        self.min_p: list[float] = []  # per sampled row
        self.top_k: list[int] = []  # per sampled row, -1 when off
        self.top_p: list[float] = []  # per sampled row
        self.rep_rows: list[int] = []
        self.rep_values: list[float] = []
        self.fp_rows: list[int] = []
        self.freq_values: list[float] = []
        self.pres_values: list[float] = []
        self.bias_index: list[int] = []  # flat (row * V + token) indices
        self.bias_values: list[float] = []
        self.mask_index: list[int] = []  # flat indices forced to -inf (min_tokens)
        self.logprob_rows: list[int] = []
        self.logprob_n: list[int] = []
        v = vocab_size
        for i, row in enumerate(rows):
            p = row.params
            if p.is_greedy:
                self.greedy.append(i)
            else:
                self.sampled.append(i)
                self.temperature.append(p.temperature)
                self.min_p.append(p.min_p)
                top_k = p.top_k if p.top_k is not None and 0 < p.top_k < v else -1
                self.top_k.append(top_k)
                self.top_p.append(p.top_p)
            if p.repetition_penalty != 1.0:
                self.rep_rows.append(i)
                self.rep_values.append(p.repetition_penalty)
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
                self.fp_rows.append(i)
                self.freq_values.append(p.frequency_penalty)
                self.pres_values.append(p.presence_penalty)
            if p.logit_bias:
                for token_id, bias in p.logit_bias.items():
                    if 0 <= token_id < v:
                        self.bias_index.append(i * v + token_id)
                        self.bias_values.append(bias)
            if len(row.output_token_ids) < p.min_tokens and i not in constrained:
                stops = set(p.stop_token_ids or ())
                if row.eos_token_id is not None and not p.ignore_eos:
                    stops.add(row.eos_token_id)  # with ignore_eos, eos is an ordinary token: nothing to mask
                self.mask_index.extend(i * v + t for t in stops if 0 <= t < v)
            if p.needs_sample_logprob:  # asked for, or to rank best_of candidates (their logprob only)
                self.logprob_rows.append(i)
                self.logprob_n.append(min(p.logprobs or 0, v))

    @property
    def modifies_logits(self) -> bool:
        return bool(
            self.sampled or self.rep_rows or self.fp_rows or self.bias_index or self.mask_index or self.guide
        )


class Sampler:
    """Samples one token per row of a logits batch; see the module docstring for the method.

    ``seed`` seeds the generator of the *unseeded* rows (for reproducible tests); seeded requests never use it.
    """

    def __init__(self, *, logprobs_mode: LogprobsMode = "raw", seed: int | None = None) -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # Rejection rounds for top_p before giving up on a row and taking its most probable token (which is
        # always inside the nucleus). A row is redrawn only with probability (mass outside the nucleus /
        # mass of its current support), and each redraw shrinks that outside mass geometrically in
        # expectation, so reaching this bound has a probability far below anything observable.
        self.max_top_p_rounds = 64

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, rows: SequenceOf[SamplingRow], guide: TokenBitmask | None = None
    ) -> list[SampleResult]:
        """One token per row; ``guide`` masks the constrained rows to their grammar's allowed tokens."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if batch != len(rows):
            raise ValueError(f"{batch} logits rows but {len(rows)} sampling rows")
        if batch == 0:
            return []
        plan = _Plan(rows, vocab, guide)

        if not plan.modifies_logits:
            # Pure greedy without penalties: an argmax and nothing else (argmax is exact in any dtype).
            fast = argmax_rows(logits)
            tokens = logits.argmax(dim=-1) if fast is None else fast
            processed = logits
        else:
            # Our own contiguous float32 copy: the caller's logits stay intact (raw logprobs, speculative
            # verification) and flat indexing (row * V + token) is valid.
            work = torch.empty((batch, vocab), dtype=torch.float32, device=logits.device)
            work.copy_(logits)
            self._apply_logit_bias(work, plan)
            self._apply_penalties(work, plan, rows)
            if plan.mask_index:
                flat = work.view(-1)
                flat.index_fill_(0, self._long(plan.mask_index, work.device), _NEG_INF)
            if plan.guide is not None:
                apply_bitmask(work, plan.guide)
            tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
            if plan.greedy:
                self._sample_greedy(work, plan, tokens)
            if plan.sampled:
                self._apply_temperature(work, plan)
            processed = work  # penalties + temperature; truncation below never writes into ``work``
            if plan.sampled:
                self._sample_random(work, plan, rows, tokens)

        token_list: list[int] = tokens.tolist()
        if not plan.logprob_rows:
            return [SampleResult(t) for t in token_list]
        source = logits if self.logprobs_mode == "raw" else processed
        return self._with_logprobs(source, plan, tokens, token_list)

    # ---- speculative decoding support --------------------------------------------------------------------

    @torch.inference_mode()
    def target_probs(self, logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
        """The distribution :meth:`sample` draws each row's token from, as float32 probabilities ``[B, V]``.

        Every option is applied exactly as in :meth:`sample` (top_p keeps the same nucleus, ties included);
        greedy rows are one-hot at the token :meth:`sample` would pick. Speculative verification needs the
        whole distribution rather than one draw: it accepts a proposed token with probability p / q.
        """
        batch, vocab = logits.shape
        if batch != len(rows):
            raise ValueError(f"{batch} logits rows but {len(rows)} sampling rows")
        plan = _Plan(rows, vocab)
        work = self._processed(logits, plan, rows)
        probs = torch.zeros((batch, vocab), dtype=torch.float32, device=logits.device)
        if plan.greedy:
            index = self._long(plan.greedy, work.device)
            probs[index, work.index_select(0, index).argmax(dim=-1)] = 1.0
        if plan.sampled:
            self._apply_temperature(work, plan)
            index = self._long(plan.sampled, work.device)
            p = self._apply_min_p_top_k(work.index_select(0, index), plan).softmax(dim=-1)
            p_rows = [j for j, top_p in enumerate(plan.top_p) if top_p < 1.0]
            if p_rows:
                p_index = self._long(p_rows, work.device)
                top_p = torch.tensor([plan.top_p[j] for j in p_rows], dtype=torch.float64, device=work.device)
                p[p_index] = self._nucleus(p.index_select(0, p_index), top_p)
            probs[index] = p / p.sum(dim=-1, keepdim=True)
        return probs

    @staticmethod
    def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """``probs`` with the tokens outside each row's nucleus zeroed: a token is inside iff the mass of
        strictly more probable tokens is below ``top_p`` (the rule :meth:`_top_p_rejection` samples by)."""
        ascending = probs.sort(dim=-1).values.contiguous()
        cumulative = ascending.to(torch.float64).cumsum(dim=-1)
        total = cumulative[:, -1:]
        # Mass of the tokens at most as probable as each token: the cumulative sum up to its last tie.
        at_most = cumulative.gather(1, torch.searchsorted(ascending, probs.contiguous(), right=True) - 1)
        inside = (total - at_most) < top_p.unsqueeze(1) * total
        return torch.where(inside, probs, 0.0)

    @torch.inference_mode()
    def score(
        self, logits: torch.Tensor, rows: SequenceOf[SamplingRow], token_ids: SequenceOf[int]
    ) -> list[SampleResult]:
        """Results for tokens chosen elsewhere (speculative decoding): the logprobs :meth:`sample` would
        have reported had it drawn ``token_ids``."""
        batch, vocab = logits.shape
        if batch != len(rows) or batch != len(token_ids):
            raise ValueError(f"{batch} logits rows, {len(rows)} sampling rows and {len(token_ids)} tokens")
        plan = _Plan(rows, vocab)
        token_list = [int(t) for t in token_ids]
        if not plan.logprob_rows:
            return [SampleResult(t) for t in token_list]
        source = logits
        if self.logprobs_mode == "processed":
            source = self._processed(logits, plan, rows)
            if plan.sampled:
                self._apply_temperature(source, plan)
        tokens = torch.tensor(token_list, dtype=torch.long, device=logits.device)
        return self._with_logprobs(source, plan, tokens, token_list)

    def _processed(self, logits: torch.Tensor, plan: _Plan, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
        """A float32 copy of ``logits`` with logit_bias, penalties and the min_tokens mask applied."""
        work = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        work.copy_(logits)
        self._apply_logit_bias(work, plan)
        self._apply_penalties(work, plan, rows)
        if plan.mask_index:
            work.view(-1).index_fill_(0, self._long(plan.mask_index, work.device), _NEG_INF)
        return work

    # ---- logits processing -------------------------------------------------------------------------------

    @staticmethod
    def _long(values: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    def _apply_logit_bias(self, work: torch.Tensor, plan: _Plan) -> None:
        if plan.bias_index:
            values = torch.tensor(plan.bias_values, dtype=torch.float32, device=work.device)
            work.view(-1).index_add_(0, self._long(plan.bias_index, work.device), values)

    def _flat_token_index(
        self, row_ids: list[int], token_lists: list[list[int]], vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unique flat indices ``row * V + token`` of the given rows' tokens, and their occurrence counts.

        Sparse on purpose: the cost scales with the number of history tokens, not with ``rows x V``.
        Sorting then ``unique_consecutive`` is much faster than ``torch.unique`` on CPU.
        """
        lengths = [len(t) for t in token_lists]
        tokens = self._long(list(itertools.chain.from_iterable(token_lists)), device)
        row_of = torch.repeat_interleave(self._long(row_ids, device), self._long(lengths, device))
        valid = (tokens >= 0) & (tokens < vocab)  # a bad id must not leak into the neighbouring row
        flat = (row_of * vocab + tokens)[valid]
        unique, counts = torch.unique_consecutive(flat.sort().values, return_counts=True)
        return unique, counts

    def _apply_penalties(self, work: torch.Tensor, plan: _Plan, rows: SequenceOf[SamplingRow]) -> None:
        batch, vocab = work.shape
        flat = work.view(-1)
        if plan.rep_rows:
            seen = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in plan.rep_rows]
            index, _ = self._flat_token_index(plan.rep_rows, seen, vocab, work.device)
            if index.numel():
                per_row = torch.ones(batch, dtype=torch.float32, device=work.device)
                per_row[self._long(plan.rep_rows, work.device)] = torch.tensor(
                    plan.rep_values, dtype=torch.float32, device=work.device
                )
                penalty = per_row[index // vocab]
                values = flat[index]
                # Divide positive / multiply negative logits: both make a seen token less likely.
                flat[index] = torch.where(values > 0, values / penalty, values * penalty)
        if plan.fp_rows:
            outputs = [list(rows[i].output_token_ids) for i in plan.fp_rows]
            index, counts = self._flat_token_index(plan.fp_rows, outputs, vocab, work.device)
            if index.numel():
                freq = torch.zeros(batch, dtype=torch.float32, device=work.device)
                pres = torch.zeros(batch, dtype=torch.float32, device=work.device)
                fp_rows = self._long(plan.fp_rows, work.device)
                freq[fp_rows] = torch.tensor(plan.freq_values, dtype=torch.float32, device=work.device)
                pres[fp_rows] = torch.tensor(plan.pres_values, dtype=torch.float32, device=work.device)
                row_of = index // vocab
                # Exact integer counts from the sort, so the result does not depend on accumulation order.
                flat[index] -= freq[row_of] * counts.to(torch.float32) + pres[row_of]

    def _apply_temperature(self, work: torch.Tensor, plan: _Plan) -> None:
        if all(t == 1.0 for t in plan.temperature):
            return
        divisor = torch.ones(work.shape[0], 1, dtype=torch.float32, device=work.device)
        divisor[self._long(plan.sampled, work.device), 0] = torch.tensor(
            plan.temperature, dtype=torch.float32, device=work.device
        )
        work.div_(divisor)

    # ---- drawing -----------------------------------------------------------------------------------------

    def _sample_greedy(self, work: torch.Tensor, plan: _Plan, tokens: torch.Tensor) -> None:
        if len(plan.greedy) == work.shape[0]:
            fast = argmax_rows(work)
            tokens.copy_(work.argmax(dim=-1) if fast is None else fast)
            return
        index = self._long(plan.greedy, work.device)
        tokens[index] = work.index_select(0, index).argmax(dim=-1)

    def _uniforms(
        self,
        local_rows: list[int],
        plan: _Plan,
        rows: SequenceOf[SamplingRow],
        draw: int,
        device: torch.device,
    ) -> torch.Tensor:
        """One uniform per given sampled row (indices into ``plan.sampled``), float64 on ``device``."""
        unseeded = [j for j in local_rows if rows[plan.sampled[j]].params.seed is None]
        fresh = iter(torch.rand(len(unseeded), dtype=torch.float64, generator=self._generator).tolist())
        values: list[float] = []
        for j in local_rows:
            row = rows[plan.sampled[j]]
            seed = row.params.seed
            if seed is None:
                values.append(next(fresh))
            else:
                values.append(seeded_uniform(seed, row.seq_index, len(row.output_token_ids), draw))
        return torch.tensor(values, dtype=torch.float64, device=device)

    def _apply_min_p_top_k(self, x: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """The sampled rows ``x`` (after temperature) with tokens below their min_p / top_k cut set to -inf.

        min_p and top_k both keep the tokens at or above a per-row threshold; keeping the intersection is
        the same as applying them one after the other, so one fused pass applies both.
        """
        device = x.device
        n_sampled = len(plan.sampled)
        threshold: torch.Tensor | None = None
        if any(m > 0.0 for m in plan.min_p):
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed. log(0) = -inf keeps all.
            log_min_p = torch.tensor(plan.min_p, dtype=torch.float32, device=device).log().unsqueeze(1)
            threshold = x.amax(dim=-1, keepdim=True) + log_min_p
        k_rows = [j for j, k in enumerate(plan.top_k) if k > 0]
        if k_rows:
            # The k-th largest value (ties with it are kept), from one topk over the rows that use top_k.
            k_values = self._long([plan.top_k[j] for j in k_rows], device)
            if len(k_rows) == n_sampled:  # the common case: no row gather (each costs a parallel region)
                kth = x.topk(max(plan.top_k), dim=-1).values.gather(1, (k_values - 1).unsqueeze(1))
            else:
                k_index = self._long(k_rows, device)
                top = x.index_select(0, k_index).topk(max(plan.top_k), dim=-1).values
                kth = torch.full((n_sampled, 1), _NEG_INF, dtype=torch.float32, device=device)
                kth[k_index] = top.gather(1, (k_values - 1).unsqueeze(1))
            threshold = kth if threshold is None else torch.maximum(threshold, kth)
        if threshold is not None:
            x = torch.where(x < threshold, _NEG_INF, x)  # out of place: ``work`` may be needed for logprobs
        return x

    def _sample_random(
        self, work: torch.Tensor, plan: _Plan, rows: SequenceOf[SamplingRow], tokens: torch.Tensor
    ) -> None:
        device = work.device
        n_sampled = len(plan.sampled)
        vocab = work.shape[1]
        sampled_index = self._long(plan.sampled, device)
        x = work if n_sampled == work.shape[0] else work.index_select(0, sampled_index)
        x = self._apply_min_p_top_k(x, plan)

        probs = x.softmax(dim=-1)
        # Whole blocks for the two-level CDF (top_p's test sums them too); the padding is never drawn.
        probs = pad_to_cdf_blocks(probs)
        chosen = invert_cdf(probs, self._uniforms(list(range(n_sampled)), plan, rows, 0, device))
        p_rows = [j for j, p in enumerate(plan.top_p) if p < 1.0]
        if p_rows:
            p_index = self._long(p_rows, device)
            top_p = torch.tensor([plan.top_p[j] for j in p_rows], dtype=torch.float64, device=device)
            p_probs = probs if len(p_rows) == n_sampled else probs.index_select(0, p_index)
            chosen[p_index] = self._top_p_rejection(p_probs, top_p, chosen[p_index], p_rows, plan, rows)
        # Only NaN logits (a model bug) can land in the padding; clamping keeps the step from crashing.
        tokens[sampled_index] = chosen.clamp_max_(vocab - 1)

    def _top_p_rejection(
        self,
        probs: torch.Tensor,
        top_p: torch.Tensor,
        chosen: torch.Tensor,
        local_rows: list[int],
        plan: _Plan,
        rows: SequenceOf[SamplingRow],
    ) -> torch.Tensor:
        """Redraw the rows whose token fell outside their nucleus until every token is inside.

        A token is inside iff the mass of strictly more probable tokens is below ``top_p * total``: the set
        vLLM's sort-based mask keeps, except that all tokens tied with the last kept one are kept. The
        accepted token follows the renormalised nucleus distribution exactly: each round draws from a
        superset of the nucleus and stops when the draw lands inside it.
        """
        device = probs.device
        total = block_mass(probs).sum(dim=-1)
        chosen = chosen.clone()
        pending = torch.arange(probs.shape[0], device=device)
        pending_probs = probs  # the full (min_p/top_k-masked) distribution of each pending row
        for draw in range(1, self.max_top_p_rounds + 1):
            pivot = pending_probs.gather(1, chosen[pending].unsqueeze(1))
            above = torch.where(pending_probs > pivot, pending_probs, 0.0)
            rejected = block_mass(above).sum(dim=-1) >= top_p[pending] * total[pending]
            reject_list: list[int] = rejected.nonzero().squeeze(1).tolist()
            if not reject_list:
                return chosen
            keep = torch.tensor(reject_list, dtype=torch.long, device=device)
            pending = pending[keep]
            pending_probs = pending_probs[keep]
            # Every token at most as probable as the rejected one is outside the nucleus too: redraw among
            # the strictly more probable ones (``above`` is that restricted, unnormalised distribution).
            redraw_rows = [local_rows[i] for i in pending.tolist()]
            chosen[pending] = invert_cdf(above[keep], self._uniforms(redraw_rows, plan, rows, draw, device))
        chosen[pending] = pending_probs.argmax(dim=-1)  # the most probable token is always in the nucleus
        return chosen

    # ---- logprobs ----------------------------------------------------------------------------------------

    @staticmethod
    def _with_logprobs(
        source: torch.Tensor, plan: _Plan, tokens: torch.Tensor, token_list: list[int]
    ) -> list[SampleResult]:
        index = torch.tensor(plan.logprob_rows, dtype=torch.long, device=source.device)
        logprobs = source.index_select(0, index).to(torch.float32).log_softmax(dim=-1)
        chosen: list[float] = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
        n_max = max(plan.logprob_n)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if n_max > 0:
            top = logprobs.topk(n_max, dim=-1)  # sorted, most probable first
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        results = [SampleResult(t) for t in token_list]
        for j, (i, n) in enumerate(zip(plan.logprob_rows, plan.logprob_n, strict=True)):
            top_dict = dict(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n else {}
            results[i] = SampleResult(token_list[i], chosen[j], top_dict)
        return results
