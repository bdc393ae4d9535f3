"""A Llama decoder layer of a few-token decode step in one C call (``decode_layer.c``).

A layer's weights, norms and cache are checked once and laid out in a ``DecodeLayer`` struct; each step then
fills one ``DecodeStep`` (its metadata and buffers, shared by every layer) and calls ``decode_layer`` once per
layer, instead of ten kernel wrappers that each check their tensors again. It runs the same kernels with the
same arguments as the Python layer, so the numbers are the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

import app.engine.kernels.library as library
from app.engine.kernels.attention import bf16_attention_supported
from app.engine.kernels.cpu_features import kernel_settings
from app.engine.kernels.matmul import bf16_matmul_supported, gemm_packed
from app.engine.kernels.qblock import QK, QBlockWeight, _scratch_floats, qblock_isa

__all__ = [
    "DecodeLayer",
    "DecodeStepBuffers",
    "LayerWeights",
    "bf16_values_supported",
    "decode_layer_enabled",
    "use_decode_layer",
]

_MAX_QBLOCKS = 1024  # qblock_matmul.c's MAX_BLOCKS
_F32, _QBLOCK, _BF16, _BF16_SWIGLU = 0, 1, 2, 3  # decode_layer.c's LINEAR_* kinds
_BF16_KINDS = {_BF16, _BF16_SWIGLU}
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [
        *(("w", _p), ("d", _p), ("m", _p), ("bias", _p)),
        *(("in_features", _i64), ("out_features", _i64)),
        *(("kind", _i32), ("bits", _i32), ("offset", _i32), ("has_min", _i32)),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *(("in_norm", _p), ("post_norm", _p), ("k_cache", _p), ("v_cache", _p)),
        *(("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear)),
        *(("hidden", _i64), ("inter", _i64), ("heads", _i64), ("kv_heads", _i64)),
        *(("head_dim", _i64), ("block_size", _i64), ("eps", _f32), ("scale", _f32)),
        *(("kv_bf16", _i32), ("bf16_rows", _i32)),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *(("cos", _p), ("sin", _p), ("slots", _p), ("tables", _p), ("context_lens", _p), ("rows", _p)),
        *(("h", _p), ("qkv", _p), ("attn", _p), ("gate_up", _p), ("mid", _p), ("scratch", _p)),
        *(("tokens", _i64), ("bt_stride", _i64), ("seqs", _i64), ("max_context", _i64)),
        *(("attn_per_thread", _i64), ("threads", _i32), ("use_pool", _i32), ("isa", _i32), ("attn_mode", _i32)),
    ]


# use_decode_layer's choice; None: the settings' (INF_ENGINE_DISABLE_DECODE_LAYER=1 runs every step through the
# Python layers, to compare, or to rule the C layer out)
_enabled: bool | None = None


def use_decode_layer(on: bool | None = True) -> None:
    """Run few-token decode steps layer by layer in C (the default) or through the Python layers (the same
    numbers; for tests and comparisons); None goes back to the settings' ``disable_decode_layer``."""
    global _enabled
    _enabled = on


def decode_layer_enabled() -> bool:
    on = not kernel_settings().disable_decode_layer if _enabled is None else _enabled
    return on and library.get() is not None


@dataclass(frozen=True)
class LayerWeights:
    """One projection as its Linear holds it: a float32 ``weight`` ``[out, in]`` stored column-major, a bfloat16
    one stored row-major (no bias), or GGUF blocks (``qweight``); ``bias`` float32 or None."""

    weight: torch.Tensor
    qweight: QBlockWeight | None
    bias: torch.Tensor | None


def _linear_struct(
    lin: LayerWeights, in_features: int, out_features: int, *, swiglu: bool = False
) -> _Linear | None:
    """``swiglu``: the fused gate_up projection of an MLP whose width is a multiple of 32; a bfloat16 one is
    packed for bf16_gemm_swiglu (product and SwiGLU in one pass), as the Python layer runs it."""
    bias = lin.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.device.type != "cpu"):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    q = lin.qweight
    if q is not None:
        blocks = -(-in_features // QK)
        if (q.in_features, q.out_features) != (in_features, out_features) or blocks > _MAX_QBLOCKS:
            return None
        if q.bits not in (4, 8) or (q.bits == 4 and blocks % 2):
            return None
        ptrs = (q.codes.data_ptr(), q.d.data_ptr(), q.m.data_ptr(), bias_ptr)
        return _Linear(*ptrs, in_features, out_features, _QBLOCK, q.bits, q.offset, int(q.has_min))
    w = lin.weight
    if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape == (out_features, in_features):
        if bias is not None or in_features % 2 or not bf16_matmul_supported():
            return None
        lib = library.get()
        if lib is None:
            return None
        packed = gemm_packed(w, lib, swiglu=swiglu)  # the Python layer's copy: kept on the weight
        kind = _BF16_SWIGLU if swiglu else _BF16
        return _Linear(packed.data_ptr(), None, None, None, in_features, out_features, kind, 0, 0, 0)
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.shape != (out_features, in_features):
        return None
    if not w.t().is_contiguous():  # small_matmul reads W^T rows
        return None
    return _Linear(w.data_ptr(), None, None, bias_ptr, in_features, out_features, _F32, 0, 0, 0)


def bf16_values_supported(layer: DecodeLayer) -> bool:
    """A bfloat16 model's attention runs in C as the Python layer runs it: bfloat16 products on a bfloat16
    cache (AVX512-BF16). Elsewhere the Python layer rounds the query in a copy first (mode 1): not done here."""
    s = layer.struct
    return bool(s.kv_bf16) and s.head_dim % 32 == 0 and bf16_attention_supported()


class DecodeLayer:
    """One layer's struct, or ``DecodeLayer.build`` gives None where the C layer does not apply."""

    def __init__(self, struct: _Layer, keep: tuple[object, ...], all_qblock: bool) -> None:
        self.struct = struct
        self.keep = keep  # the tensors whose addresses the struct holds
        self.all_qblock = all_qblock
        self.bf16_rows = bool(struct.bf16_rows)
        self.qkv_out = struct.qkv.out_features

    @classmethod
    def build(
        cls,
        *,
        norms: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        projections: tuple[LayerWeights, LayerWeights, LayerWeights, LayerWeights],
        kv_cache: torch.Tensor,
        heads: int,
        head_dim: int,
        scale: float,
    ) -> DecodeLayer | None:
        """``projections``: qkv (fused), o, gate_up (fused), down; ``kv_cache`` one layer's
        ``[2, blocks, block_size, kv_heads, head_dim]``."""
        hidden = norms[0].numel()
        kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        down = projections[3]
        inter = down.weight.shape[1] if down.qweight is None else down.qweight.in_features
        for norm in norms:
            if norm.dtype != torch.float32 or norm.device.type != "cpu" or not norm.is_contiguous():
                return None
        if (
            hidden % 8
            or inter % 8
            or head_dim % 16
            or head_dim > 128
            or heads > 256
            or heads % kv_heads
            or kv_cache.shape[4] != head_dim
            or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous()
        ):
            return None
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        shapes = ((hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * inter), (inter, hidden))
        linears = [
            _linear_struct(p, k, n, swiglu=i == 2 and inter % 32 == 0)
            for i, (p, (k, n)) in enumerate(zip(projections, shapes, strict=True))
        ]
        if any(lin is None for lin in linears):
            return None
        kinds = {lin.kind for lin in linears if lin is not None}
        bf16_rows = bool(kinds & _BF16_KINDS)
        if bf16_rows and (not kinds <= _BF16_KINDS or kv_cache.dtype != torch.bfloat16):
            return None  # bfloat16 rows need every product in bfloat16 and the bfloat16 attention
        struct = _Layer(
            norms[0].data_ptr(),
            norms[1].data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            *linears,
            hidden,
            inter,
            heads,
            kv_heads,
            head_dim,
            block_size,
            eps,
            scale,
            int(kv_cache.dtype == torch.bfloat16),
            int(bf16_rows),
        )
        keep = (norms, projections, kv_cache)
        return cls(struct, keep, all(p.qweight is not None for p in projections))


class DecodeStepBuffers:
    """The step struct and the buffers its layers write, for ``tokens`` rows."""

    def __init__(
        self,
        first: DecodeLayer,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
        rows: torch.Tensor | None,
        max_context: int,
        bf16_values: bool = False,
    ) -> None:
        """``bf16_values``: a bfloat16 model's attention, bfloat16 products on its bfloat16 cache (the decode
        kernel's mode 2; check :func:`bf16_values_supported` first)."""
        s = first.struct
        t = cos.shape[0]
        threads = torch.get_num_threads()
        width = max(s.qkv.out_features, s.gate_up.out_features, s.hidden)
        rows_dtype = torch.bfloat16 if first.bf16_rows else torch.float32
        # as kernels/attention.py sizes it (a bfloat16 query and output are widened in a task's scratch)
        io_rows = 2 * s.heads * s.head_dim if first.bf16_rows else 0
        per_thread = ((s.heads + 2) * max_context + io_rows + 2) & ~1
        scratch = max(
            (threads - 1) * t * width,  # small_matmul
            _scratch_floats(t, max(s.hidden, s.inter, s.heads * s.head_dim)),  # qblock_matmul
            threads * per_thread,  # paged_decode_attention
        )
        self.h = torch.empty(t, s.hidden, dtype=rows_dtype)
        self.qkv = torch.empty(t, s.qkv.out_features, dtype=rows_dtype)
        self.attn = torch.empty(t, s.heads * s.head_dim, dtype=rows_dtype)
        self.gate_up = torch.empty(t, 2 * s.inter, dtype=rows_dtype)
        self.mid = torch.empty(t, s.inter, dtype=rows_dtype)
        self.out = torch.empty(t, s.hidden, dtype=rows_dtype)
        self.scratch = library.scratch(scratch)
        self.keep = (cos, sin, slots, tables, context_lens, rows)
        self.struct = _Step(
            *(cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), context_lens.data_ptr()),
            None if rows is None else rows.data_ptr(),
            *(self.h.data_ptr(), self.qkv.data_ptr(), self.attn.data_ptr()),
            *(self.gate_up.data_ptr(), self.mid.data_ptr(), self.scratch.data_ptr()),
            *(t, tables.stride(0), context_lens.shape[0], max_context, per_thread),
            threads,
            library.use_pool(t),
            int(qblock_isa() == "vnni"),
            2 if bf16_values else 0,
        )

    def run(self, layers: list[DecodeLayer], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over ``x`` (float32 ``[T, hidden]``, contiguous; it becomes the residual stream, updated
        in place): returns the last layer's output (bfloat16 for a bfloat16 model's layers) and the residual
        stream."""
        lib = library.get()
        if lib is None:
            raise RuntimeError("the C kernels were switched off during a step")
        step = ctypes.byref(self.struct)
        call, out_ptr, x_ptr = lib.decode_layer, self.out.data_ptr(), x.data_ptr()
        for i, layer in enumerate(layers):
            src = x_ptr if i == 0 else out_ptr
            if call(ctypes.byref(layer.struct), step, src, x_ptr, int(i > 0), out_ptr):
                raise RuntimeError("decode_layer: a block matrix was refused (its checks should have caught it)")
        return self.out, x
