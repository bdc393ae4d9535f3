"""Sampling operations shared by the sampler and speculative decoding.

:func:`invert_cdf` is the engine's one random draw of a token from a distribution: the sampler's draws (and
its top_p redraws), a draft model's proposals and the rejection sampler's final token all go through it. It
takes one uniform per row (not ``torch.multinomial`` nor the exponential race, which spend one random number
per vocabulary entry), so a seeded row's token depends only on its own probabilities and its uniform.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CDF_BLOCK", "block_mass", "invert_cdf", "pad_to_cdf_blocks"]

# Inverse-CDF sampling scans the vocabulary in blocks of this many entries (see invert_cdf).
CDF_BLOCK = 256


def pad_to_cdf_blocks(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` itself when its rows are one block or whole blocks, else a copy padded with zero mass to whole
    blocks (the padding is never drawn, except from a row holding NaN)."""
    vocab = probs.shape[1]
    if vocab > CDF_BLOCK and vocab % CDF_BLOCK:
        return F.pad(probs, (0, CDF_BLOCK - vocab % CDF_BLOCK))
    return probs


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds ``target`` ([R, 1]); shape [R, 1].

    ``target`` can round up to the row's total; the result is then clamped to the first index reaching
    the total, which always carries non-zero mass, so a zero-probability entry is never returned.
    """
    found = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(found, last)


def block_mass(probs: torch.Tensor) -> torch.Tensor:
    """Mass of each ``CDF_BLOCK``-wide block of each row, float64 [R, num_blocks] (rows of whole blocks, or of
    one block: see :func:`pad_to_cdf_blocks`).

    Summed in float32 inside a block and then widened: a float64 reduction over the whole row costs ~10x
    more on CPU, and many short per-output reductions are summed in the same order whatever the number of
    rows (a single long reduction may be split across threads when the batch has one row), which keeps
    seeded rows independent of the batch down to the last bit.
    """
    rows, vocab = probs.shape
    width = min(CDF_BLOCK, vocab)  # a small vocabulary is one block
    return probs.view(rows, vocab // width, width).sum(dim=-1).to(torch.float64)


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids drawn by inverse CDF from non-negative, unnormalised ``probs`` ``[R, V]`` with one uniform
    per row ``u`` (float64, moved to ``probs``' device); never a zero-probability token.

    Two levels, because a float64 ``cumsum`` over the whole vocabulary was the most expensive step of
    the sampler on CPU: the cumulative block masses locate the block, then only that block is scanned.
    Cumulating in float64 keeps the tail tokens' share of mass, which float32 sums near 1.0 round away.
    Rows that are not whole blocks are padded here (with zero mass); a caller that also needs the block
    masses pads first with :func:`pad_to_cdf_blocks`.
    """
    vocab = probs.shape[1]
    padded = pad_to_cdf_blocks(probs)
    u = u.to(padded.device)
    rows, padded_vocab = padded.shape
    width = min(CDF_BLOCK, padded_vocab)
    block_cdf = block_mass(padded).cumsum(dim=-1)
    target = u.unsqueeze(1) * block_cdf[:, -1:]
    block = _search(block_cdf, target).clamp_max_(block_cdf.shape[1] - 1)  # clamp: NaN rows only
    # Mass before the chosen block: the previous block's cumulative value (0 for the first block).
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
    blocks = padded.view(rows, -1, width)
    inner = blocks.gather(1, block.unsqueeze(2).expand(rows, 1, width)).squeeze(1)
    offset = _search(inner.cumsum(dim=-1, dtype=torch.float64), target - before).clamp_max_(width - 1)
    tokens = (block * width + offset).squeeze(1)
    # Only a NaN row can land in padding added here; clamping keeps its token inside the vocabulary.
    return tokens if padded is probs else tokens.clamp_max_(vocab - 1)
