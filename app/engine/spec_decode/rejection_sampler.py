"""Verification: speculative rejection sampling of a batch of proposals against the target's distributions."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from app.engine.sampling_ops import invert_cdf

if TYPE_CHECKING:
    from app.engine.spec_decode.proposers import Proposal

__all__ = ["verify"]


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
    tokens = invert_cdf(final, u_final.index_select(0, final_rows.cpu())).tolist()
    return num_accepted, [int(t) for t in tokens]
