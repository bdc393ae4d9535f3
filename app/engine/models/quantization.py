"""Weight-only quantization of a loaded model's matrix products (``EngineConfig.quantization``, vLLM's word).

``"int8"``: every :class:`~app.engine.models.layers.Linear` weight becomes int8 with one float scale per output
channel (symmetric, ``scale = max|w| / 127``), a quarter of the float32 bytes and half of bfloat16's; the LM
head (tied to the embedding in small models, which a lookup needs in float) keeps the model's dtype. The
product (:func:`app.engine.kernels.matmul.int8_linear`) is PyTorch's CPU kernel for int8-weight matmuls (``torch._weight_int8pack_mm``, the one torchao and
gpt-fast use): activations in bfloat16, weights widened in registers, float32 accumulation. It pays off where
a step is bound by the bytes of weights it reads: one or a few sequences decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from app.engine.models.layers import Linear

__all__ = ["QUANTIZATIONS", "check_quantization", "quantize_model"]

QUANTIZATIONS = ("int8",)


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {method!r}")


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize ``model``'s Linear weights in place (CPU only); returns how many. Idempotent."""
    check_quantization(method)
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.scales is None:
            if module.weight.device.type != "cpu":
                raise ValueError(
                    f"quantization={method!r} runs on CPU; this model is on {module.weight.device}"
                )
            _quantize_int8(module)
            count += 1
    return count


def _quantize_int8(module: Linear) -> None:
    weight = module.weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    qweight = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    module.weight = nn.Parameter(qweight, requires_grad=False)
    module.scales = scales.to(torch.bfloat16)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)
