"""Building blocks shared by the model implementations (numerically matched to transformers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import app.engine.kernels as kernels
from app.engine.kernels import small_matmul
from app.engine.kernels.matmul import (
    bf16_linear,
    bf16_swiglu,
    int4_linear,
    int8_linear,
    onednn_linear,
    w8a8_linear,
)
from app.engine.kernels.qblock import QBlockWeight, qblock_linear, qblock_reference


def placeholder(*shape: int) -> nn.Parameter:
    """A weight with no storage yet (meta device): the loader gives every parameter its real tensor.

    Allocating and randomly initialising weights that are overwritten at once costs seconds for a real model.
    """
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


@dataclass
class Int8Weight:
    """An int8 copy of a float32 weight (``qweight_t`` ``[in, out]``, per-output-channel ``scales``) for
    :func:`~app.engine.kernels.matmul.w8a8_linear`. Its ``outliers`` (the input channels run in float32, with
    their float32 weight columns) come from a calibration pass: :meth:`observe` keeps the largest magnitude each
    input channel reached, :meth:`settle` takes the ``count`` largest. Until then the layer runs in float32."""

    qweight_t: torch.Tensor
    scales: torch.Tensor
    seen: torch.Tensor | None = None
    outliers: tuple[torch.Tensor, torch.Tensor] | None = None
    keep: torch.Tensor | None = None  # [in]: 0 on the outlier channels, 1 elsewhere (the fused rounding's mask)

    def observe(self, x: torch.Tensor) -> None:
        peak = x.detach().abs().amax(dim=0)
        self.seen = peak if self.seen is None else torch.maximum(self.seen, peak)

    def settle(self, weight: torch.Tensor, count: int) -> None:
        seen = self.seen if self.seen is not None else torch.zeros(weight.shape[1])
        channels = seen.topk(min(count, seen.numel())).indices.sort().values
        self.qweight_t[channels] = 0  # those channels are multiplied in float32 instead
        self.outliers = (channels, weight.detach().index_select(1, channels).t().contiguous())
        self.keep = torch.ones(weight.shape[1]).index_fill_(0, channels, 0.0)
        self.seen = None


class Linear(nn.Module):
    """``y = x @ W.T + b`` with placeholder weights (see :func:`placeholder`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = placeholder(out_features, in_features)
        self.bias = placeholder(out_features) if bias else None
        # quantization: per-output-channel scales of an int8 weight, or (group_size > 0) the per-group scales
        # and zeros of a packed 4-bit weight
        self.scales: torch.Tensor | None = None
        self.group_size = 0
        # quantization: a GGUF file's own blocks in the layout of the qblock kernel (``weight`` is their codes)
        self.qweight: QBlockWeight | None = None
        # blocks beside float weights (quantization "auto"): the blocks serve products of at most this many rows,
        # the float weights the larger ones; None: the blocks serve every product (``weight`` is their codes)
        self.block_rows: int | None = None
        # quantization "auto" without bfloat16 products: an int8 copy of the float32 weight for the products of
        # more rows than the blocks serve (w8a8_linear), once calibrated
        self.int8: Int8Weight | None = None

    def blocks_serve(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows runs on the GGUF blocks."""
        return self.qweight is not None and (self.block_rows is None or rows <= self.block_rows)

    def forward(self, x: torch.Tensor, keep_bf16: bool = False) -> torch.Tensor:
        """``keep_bf16``: a bfloat16 weight's CPU product (without bias) comes back in bfloat16, as oneDNN gives
        it, for a consumer that reads bfloat16 (saves two conversions); other weights ignore it. GGUF blocks
        kept beside the weight serve the products of few rows first (quantization "auto")."""
        blocks = self.qweight
        if blocks is not None and self.blocks_serve(x.shape[0]):
            # bfloat16 activations (blocks beside bfloat16 weights) widen exactly; the kernel rounds them to int8
            out = qblock_linear(x.float() if x.dtype == torch.bfloat16 else x, blocks, self.bias)
            return qblock_reference(x, blocks, self.bias) if out is None else out.to(x.dtype)
        int8 = self.int8
        if int8 is not None and x.dtype == torch.float32 and x.dim() == 2:
            if int8.outliers is not None:
                return w8a8_linear(x, int8.qweight_t, int8.scales, self.bias, int8.outliers, int8.keep)
            int8.observe(x)  # not calibrated yet: the float32 product, and the input's channels are measured
        if keep_bf16 and self.bias is None and bf16_io(self):
            out = bf16_linear(x, self.weight, keep_bf16=True)
            if out is not None:
                return out
        if self.scales is not None:
            if self.group_size:
                return int4_linear(x, self.weight, self.scales, self.group_size, self.bias)
            return int8_linear(x, self.weight, self.scales, self.bias)
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: on CPU, by the multi-threaded C kernel for the few-row products of decoding and by oneDNN
    for the larger ones; a bfloat16 weight with float32 activations by oneDNN's bfloat16 product."""
    if weight.dtype != x.dtype or (weight.dtype == torch.bfloat16 and x.device.type == "cpu"):
        mixed = bf16_linear(x, weight, bias)
        if mixed is not None:
            return mixed
        product = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return product if bias is None else product.add_(bias)
    out = onednn_linear(x, weight, bias)  # None for 1-2 rows, where the C kernel is faster
    if out is None:
        out = small_matmul(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = placeholder(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = placeholder(dim)
        self.bias = placeholder(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 then cast back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = placeholder(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel; bit-identical to the formula below in float32 (checked in the tests).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream step of a pre-norm block: ``residual = x + residual`` (just ``x`` when None),
        returns ``(norm(residual), residual)``. The C kernel fuses both and updates ``residual`` in place.
        ``out_dtype`` (CPU): the normed rows in bfloat16 for bfloat16 products (``x`` may be bfloat16 too)."""
        if out_dtype is not None:
            fused = kernels.add_rms_norm(x, residual, self.weight, self.eps, out_dtype)
        else:
            fused = kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        h = x if residual is None else residual + x
        normed = self.forward(h)
        return (normed if out_dtype is None else normed.to(out_dtype)), h


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width cos/sin ``[T, 1, head_dim // 2]`` for the given positions.

    Computed per step from the positions (not from a table) so any position works; the product is the same
    float32 multiply transformers does, so the values are bit-identical.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def bf16_io(module: Linear) -> bool:
    """A plain bfloat16 weight on CPU: its products take and give bfloat16 (oneDNN), so the ops around it can
    hand it bfloat16 rows and take its output as it comes."""
    return module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"


def bf16_swiglu_mlp(
    x: torch.Tensor, gate_up: Linear, down: Linear, keep_bf16: bool = False
) -> torch.Tensor | None:
    """``down(silu_mul(gate_up(x)))`` for float32 or bfloat16 ``x`` (CPU) and bfloat16 or 4-bit weights, with
    the middle kept in bfloat16: both products give bfloat16 anyway, so the widest tensors of the layer skip two
    conversions (to float32 and back) and the numbers stay those of the float32 route. ``keep_bf16``: a
    bfloat16 ``down`` without bias returns its product in bfloat16. None when it does not apply."""
    if x.dtype not in (torch.float32, torch.bfloat16) or gate_up.bias is not None:
        return None
    if gate_up.blocks_serve(x.shape[0]) or down.blocks_serve(x.shape[0]):
        return None
    # bfloat16 weights: product and SwiGLU in one pass where the kernel takes them (the same bits)
    mid = None
    if gate_up.scales is None and gate_up.weight.dtype == torch.bfloat16:
        x = x.to(torch.bfloat16)  # as bf16_linear would round it: once for either route below
        mid = bf16_swiglu(x, gate_up.weight)
    if mid is None:
        gu = _bf16_product(x, gate_up)
        if gu is None:
            return None
        h = kernels.silu_mul(gu)
        mid = silu_mul(gu.float()) if h is None else h
    if down.group_size and down.scales is not None:
        return int4_linear(mid, down.weight, down.scales, down.group_size, down.bias, torch.float32)
    if down.scales is None and down.weight.dtype == torch.bfloat16:
        return bf16_linear(mid, down.weight, down.bias, keep_bf16=keep_bf16 and down.bias is None)
    return down(mid.float())


def _bf16_product(x: torch.Tensor, lin: Linear) -> torch.Tensor | None:
    """``lin(x)`` as its product gives it, in bfloat16 (a 4-bit or bfloat16 weight, no bias), or None."""
    if lin.group_size and lin.scales is not None:
        return int4_linear(x, lin.weight, lin.scales, lin.group_size, None, torch.bfloat16)
    if lin.scales is None and lin.weight.dtype == torch.bfloat16:
        return bf16_linear(x, lin.weight, keep_bf16=True)
    return None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` of a fused ``[gate | up]`` projection."""
    fused = kernels.silu_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` written back into ``x`` (a view into the fused projection); returns ``x``."""
    if not kernels.rope_inplace(x, cos, sin):
        x.copy_(apply_rope(x, cos, sin))
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` in the "rotate half" layout (HF); equal to ``x*cos + rotate_half(x)*sin``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
