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

The package, laid out as vLLM keeps these apart:

* :mod:`.config`: :class:`SpeculativeConfig` (vLLM's ``speculative_config`` keys);
* :mod:`.metrics`: :class:`SpecDecodeStats`, the ``vllm:spec_decode_*`` counters;
* :mod:`.proposers`: :class:`Proposal`, :class:`NgramProposer` and :class:`DraftModelProposer`;
* :mod:`.rejection_sampler`: :func:`verify`, the acceptance rule and the final token's draw;
* :mod:`.decoder`: :class:`SpeculativeDecoder`, one engine step (propose, one target pass, verify, report);
* :mod:`.forward` (a forward pass over sequences with proposals appended) and :mod:`.uniforms` (the random
  numbers of proposing and verifying, counter-based for seeded requests), shared by the others.
"""

from __future__ import annotations

from app.engine.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from app.engine.spec_decode.decoder import SpeculativeDecoder
from app.engine.spec_decode.metrics import SpecDecodeStats
from app.engine.spec_decode.proposers import DraftModelProposer, NgramProposer, Proposal
from app.engine.spec_decode.rejection_sampler import verify

__all__ = [
    "SPEC_METHODS",
    "DraftModelProposer",
    "NgramProposer",
    "Proposal",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "SpeculativeDecoder",
    "verify",
]
