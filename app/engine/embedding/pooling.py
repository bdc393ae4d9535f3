"""Pooling packed token states into one vector per sequence, as sentence-transformers' Pooling module does.

The states are packed (``[total_tokens, hidden]``, the sequences one after another, no padding), so "over the
real tokens" needs no mask: a sequence's tokens are its slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.embedding.folder import POOLING_MODES


def pool(states: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """``states`` ``[total_tokens, hidden]`` of sequences of ``lengths`` (``[batch]``, int64, all > 0) ->
    ``[batch, hidden]`` by ``mode``: mean, cls (first token), max or last (last token)."""
    ends = lengths.cumsum(0)
    if mode == "cls":
        return states[ends - lengths]
    if mode == "last":
        return states[ends - 1]
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling {mode!r} is not supported (one of {', '.join(POOLING_MODES)})")
    batch, hidden = lengths.shape[0], states.shape[1]
    segment = torch.repeat_interleave(torch.arange(batch, device=states.device), lengths)
    if mode == "mean":
        # one small product [batch, tokens] @ [tokens, hidden]: each row averages its sequence's slice
        # (faster than index_add_, which CPU torch runs row by row)
        owner = segment[None, :] == torch.arange(batch, device=states.device)[:, None]
        return (owner.to(states.dtype) @ states).div_(lengths.to(states.dtype)[:, None])
    index = segment[:, None].expand(-1, hidden)
    return states.new_full((batch, hidden), float("-inf")).scatter_reduce_(0, index, states, reduce="amax")


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """L2-normalised rows (sentence-transformers' Normalize module: ``F.normalize``, eps 1e-12)."""
    return F.normalize(vectors, p=2.0, dim=1)
