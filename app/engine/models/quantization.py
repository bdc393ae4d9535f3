"""Weight-only quantization of a loaded model's matrix products (``EngineConfig.quantization``, vLLM's word).

``"int8"``: every :class:`~app.engine.models.layers.Linear` weight becomes int8 with one float scale per output
channel (symmetric, ``scale = max|w| / 127``), a quarter of the float32 bytes and half of bfloat16's; the LM
head (tied to the embedding in small models, which a lookup needs in float) keeps the model's dtype. The
product (:func:`app.engine.kernels.matmul.int8_linear`) is PyTorch's CPU kernel for int8-weight matmuls (``torch._weight_int8pack_mm``, the one torchao and
gpt-fast use): activations in bfloat16, weights widened in registers, float32 accumulation. It pays off where
a step is bound by the bytes of weights it reads: one or a few sequences decoding.

``"gguf"``: a GGUF file's own Q4_0/Q4_1 blocks run as they are, never widened to float in memory. Where the
C kernels are built, each Linear holds the blocks in the layout of ``qblock_matmul.c`` (:func:`install_qblocks`:
4-bit codes with float16 scales and mins, times activations quantized to int8 per block, llama.cpp's scheme)
and a Q8_0 LM head runs as Q8_0 too; elsewhere the 4-bit codes are packed for PyTorch's int4 CPU matmul
(``torch._weight_int4pack_mm_for_cpu``, :func:`install_q4`). The blocks come from the file, so this mode is
applied by the loader (:func:`app.engine.loading.apply_quantization`), not by :func:`quantize_model`. Other
tensors (norms, the embedding) keep the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from app.engine.kernels.qblock import QBlockWeight
from app.engine.models.layers import Int8Weight, Linear

__all__ = [
    "AUTO_BLOCK_ROWS",
    "AUTO_BLOCK_ROWS_BF16",
    "CALIBRATION_TEXT",
    "QUANTIZATIONS",
    "auto_block_rows",
    "auto_int8_products",
    "check_quantization",
    "install_q4",
    "install_qblocks",
    "install_w8a8",
    "memory_available",
    "q4_fits",
    "quantize_model",
    "settle_w8a8",
    "w8a8_pending",
]

QUANTIZATIONS = ("int8", "gguf")
GGUF_GROUP = 32  # weights per block in the GGUF formats executed here


def check_quantization(method: str | None) -> None:
    """None picks per CPU class (see :func:`auto_block_rows`); "none" keeps the loaded weights as they are."""
    if method is not None and method != "none" and method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'none' or one of {list(QUANTIZATIONS)}, got {method!r}")


#: quantization None ("auto"): a GGUF model keeps its blocks beside the float32 or bfloat16 weights, and steps
#: of at most this many rows run on the blocks (a few sequences decoding read every weight per token, so 0.63
#: bytes a weight beat 4 or 2), larger ones on the float weights (where the products, not the bytes, are the
#: time). Measured with scripts/bench_engine_rows.py, SmolLM2-135M, 2 threads. AMD EPYC AVX2, float32: blocks
#: 118/158/121/154/142 tok/s at 1/2/4/8/16 sequences against float32's 29/54/56/89/140, float32 ahead from 32
#: (199 against 137). VNNI's int8 dot products make the blocks faster per row; there they serve up to the
#: kernel's most rows.
AUTO_BLOCK_ROWS = {"avx2": 16, "vnni": 24}
#: ... and beside bfloat16 weights on a CPU with bfloat16 products, whose products of a few rows are already
#: fast: AMD EPYC AVX512-BF16, blocks 162/225/325/341/314 tok/s at 1/2/4/6/8 sequences against bfloat16's
#: 94/164/304/482/612.
AUTO_BLOCK_ROWS_BF16 = 4


def auto_block_rows(isa: str | None, bf16_products: bool = False) -> int | None:
    """The most rows the blocks serve under quantization "auto" on a CPU whose qblock kernel is ``isa`` ("avx2"
    or "vnni"; None: no C kernels, so no blocks); ``bf16_products``: beside bfloat16 weights that this CPU
    multiplies natively (AVX512-BF16)."""
    rows = None if isa is None else AUTO_BLOCK_ROWS.get(isa)
    return rows if rows is None or not bf16_products else min(rows, AUTO_BLOCK_ROWS_BF16)


def auto_int8_products(isa: str | None) -> bool:
    """Quantization "auto" beside float32 weights: whether the steps of more rows than the blocks serve run on
    int8 products (:func:`install_w8a8`) instead of float32 ones, on a CPU whose qblock kernel is ``isa``. Yes
    with VNNI's int8 dot products: measured by scripts/bench_int8_matmul.py on SmolLM2's shapes (AMD EPYC,
    AVX-512 VNNI, 2 threads), 1.5-2.4x float32's speed at 64 rows. Not on AVX2: there oneDNN's int8 product is
    slower than float32 (0.3-1.3x at 16 to 128 rows, its AVX2 kernel forced with ONEDNN_MAX_CPU_ISA=AVX2) and
    inexact (it saturates 16-bit pair sums: about 10% error)."""
    return isa == "vnni"


def memory_available() -> int | None:
    """Bytes the kernel reports available (``MemAvailable``), or None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize ``model``'s Linear weights in place (CPU only); returns how many. Idempotent."""
    check_quantization(method)
    if method == "gguf":
        raise ValueError(
            "quantization='gguf' runs a GGUF file's own 4-bit blocks: load the model from the .gguf file "
            "(LLMEngine(model='file.gguf', quantization='gguf'); the default model is one)"
        )
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.scales is None and module.qweight is None:
            if module.weight.device.type != "cpu":
                raise ValueError(
                    f"quantization={method!r} runs on CPU; this model is on {module.weight.device}"
                )
            _quantize_int8(module)
            count += 1
    changed = getattr(model, "weights_changed", None)
    if count and changed is not None:
        changed()  # what the model built from its float weights (its C decode layers) is stale
    return count


def _quantize_int8(module: Linear) -> None:
    weight = module.weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    qweight = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    module.weight = nn.Parameter(qweight, requires_grad=False)
    module.scales = scales.to(torch.bfloat16)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)


#: input channels per layer that the int8 products leave in float32 (see Int8Weight): SmolLM2's residual stream
#: has a few massive channels, and rounding a row by its largest value would flatten the rest. Perplexity over
#: 1,024 tokens of English (scripts/engine_accuracy.py's text), float32 60.97: all products in int8 63.54 (+4.2%),
#: with 8 channels per layer kept in float32, found by CALIBRATION_TEXT, 61.37 (+0.65%; 4 to 16 channels found
#: on other prose gave 61.10 to 61.42).
W8A8_OUTLIERS = 8

#: the text run once at load to find those channels (any ordinary prose does: the channels are the model's)
CALIBRATION_TEXT = (
    "The library opens at nine in the morning and closes at six. On Saturdays the reading room is quiet, and the "
    "children's corner fills with parents reading picture books aloud. Last year the city added a small garden "
    "behind the building, where volunteers grow tomatoes, beans and herbs. Visitors may borrow up to 12 books "
    "for three weeks; a late return costs 20 cents a day. How do you find a book? Search the catalogue by title, "
    "author or subject, then note the shelf number. Questions about printing, Wi-Fi or room bookings go to the "
    "front desk. def total(prices): return sum(p * 1.08 for p in prices)  # with tax"
)


def _int8_copy(weight: torch.Tensor) -> Int8Weight:
    weight = weight.detach()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    qweight = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(qweight.t().contiguous(), scales.contiguous())


def _int8_holders(model: nn.Module) -> list[tuple[Any, str, torch.Tensor]]:
    """``(owner, attribute, float weight)`` of every int8 copy: the Linears' and the LM head's."""
    holders: list[tuple[Any, str, torch.Tensor]] = [
        (m, "int8", m.weight) for m in model.modules() if isinstance(m, Linear)
    ]
    head = getattr(model, "lm_head_weight", None)
    if head is not None and hasattr(model, "lm_head_int8"):
        holders.append((model, "lm_head_int8", head()))
    return holders


def install_w8a8(model: nn.Module) -> int:
    """Give every float32 Linear, and the LM head, an int8 copy of its weight for the products the GGUF blocks do
    not serve (quantization "auto" on a CPU without bfloat16 products, see
    :func:`app.engine.kernels.matmul.w8a8_linear`); returns how many. They run in float32 until
    :func:`settle_w8a8` (after a calibration pass)."""
    count = 0
    for owner, attribute, weight in _int8_holders(model):
        if weight.dtype == torch.float32 and getattr(owner, "scales", None) is None:
            setattr(owner, attribute, _int8_copy(weight))
            count += 1
    return count


def w8a8_pending(model: nn.Module) -> bool:
    """Whether some int8 copy waits for its calibration."""
    return any(
        (int8 := getattr(owner, attribute)) is not None and int8.outliers is None
        for owner, attribute, _ in _int8_holders(model)
    )


def settle_w8a8(model: nn.Module, outliers: int = W8A8_OUTLIERS) -> None:
    """After the calibration pass: each int8 copy keeps its ``outliers`` largest input channels in float32 and
    runs its products in int8 from now on."""
    for owner, attribute, weight in _int8_holders(model):
        int8 = getattr(owner, attribute)
        if int8 is not None and int8.outliers is None:
            int8.settle(weight, outliers)


def q4_fits(module: Linear) -> bool:
    """PyTorch's int4 CPU kernel takes whole 32-blocks along a row and a multiple of 16 output rows."""
    out_features, in_features = module.weight.shape
    return module.scales is None and in_features % GGUF_GROUP == 0 and out_features % 16 == 0


def install_qblocks(module: Linear, blocks: QBlockWeight, beside_float_rows: int | None = None) -> None:
    """Make ``module`` compute on GGUF blocks packed for the qblock kernel (``module.weight`` becomes their
    codes, so moving or sizing the module still sees the bytes). ``beside_float_rows``: keep the float weight
    too, and run the blocks only for products of at most this many rows (quantization "auto")."""
    if (blocks.out_features, blocks.in_features) != tuple(module.weight.shape):
        raise ValueError(
            f"blocks of {blocks.out_features}x{blocks.in_features} do not fit a Linear of "
            f"{tuple(module.weight.shape)}"
        )
    if module.weight.device.type != "cpu":
        raise ValueError(f"quantization='gguf' runs on CPU; this model is on {module.weight.device}")
    module.qweight = blocks
    module.block_rows = beside_float_rows
    if beside_float_rows is None:
        module.weight = nn.Parameter(blocks.codes, requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)


def install_q4(module: Linear, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """Make ``module`` compute with 4-bit ``codes`` ``[out, in]`` (0..15) and per-group ``scale``/``zero``
    ``[out, in / 32]``: ``W = (code - 8) * scale + zero``."""
    out_features, in_features = module.weight.shape
    if codes.shape != (out_features, in_features) or not q4_fits(module):
        raise ValueError(
            f"4-bit weight {tuple(codes.shape)} does not fit a Linear of {out_features}x{in_features}"
        )
    if module.weight.device.type != "cpu":
        raise ValueError(f"quantization='gguf' runs on CPU; this model is on {module.weight.device}")
    with torch.inference_mode(False), torch.no_grad():
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 8)
    scale_zeros = torch.stack((scale.float(), zero.float()), dim=-1).transpose(0, 1).contiguous()
    module.weight = nn.Parameter(packed, requires_grad=False)
    module.scales = scale_zeros.to(torch.bfloat16)
    module.group_size = GGUF_GROUP
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)
