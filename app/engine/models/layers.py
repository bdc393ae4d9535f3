"""Building blocks shared by the model implementations (numerically matched to transformers)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 then cast back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width cos/sin ``[T, 1, head_dim // 2]`` for the given positions.

    Computed per step from the positions (not from a table) so any position works; the product is the same
    float32 multiply transformers does, so the values are bit-identical.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` in the "rotate half" layout (HF); equal to ``x*cos + rotate_half(x)*sin``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
