"""The GGUF block products (issue 16): our qblock kernel against PyTorch's int4 CPU matmul and oneDNN bfloat16.

    .venv/bin/python scripts/bench_qblock.py               # SmolLM2's shapes, 1-64 rows, 2 threads
    .venv/bin/python scripts/bench_qblock.py --rows 1,4 --repeats 50

Two tables, every figure measured in this run:

1. Per shape and row count, milliseconds per product with the weight hot in cache: ``qblock`` (Q4_1 blocks,
   int8 activations; its AVX512-VNNI and AVX2 builds), ``int4pack`` (``torch._weight_int4pack_mm_for_cpu``, what
   ``quantization="gguf"`` ran before, bfloat16 activations) and ``bf16`` (``F.linear`` on a bfloat16 weight,
   oneDNN).
2. One decoded token's products of the default model loaded with ``quantization="gguf"`` (every layer once,
   then the Q8_0 LM head, weights streamed from memory as in decoding): milliseconds and the bytes read per
   second, for qblock and for the int4pack copy of the same layers.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.engine.kernels.qblock import QBlockWeight, pack_q4, qblock_isa, qblock_linear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def shapes_table(rows_list: list[int], repeats: int) -> None:
    isas = ["vnni", "avx2"] if qblock_isa() == "vnni" else ["avx2"]
    print("| out x in | rows | " + " | ".join(f"qblock {i}" for i in isas) + " | int4pack | bf16 |")
    print("|---|---|" + "---|" * (len(isas) + 2))
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        scale = torch.rand(n, k // 32, generator=gen) / 100
        blocks = pack_q4(codes, scale, -8 * scale)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 8)
        scale_zeros = torch.stack((scale, torch.zeros_like(scale)), -1).transpose(0, 1).contiguous().bfloat16()
        dense = torch.randn(n, k, generator=gen).bfloat16()
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            xb = x.bfloat16()
            runs = [partial(qblock_linear, x, blocks, isa=i) for i in isas]
            runs.append(partial(torch._weight_int4pack_mm_for_cpu, xb, packed, 32, scale_zeros))
            runs.append(partial(F.linear, xb, dense))
            cells = " | ".join(f"{best_ms(run, repeats):.3f}" for run in runs)
            print(f"| {n} x {k} | {rows} | {cells} |")


def model_table(repeats: int) -> None:
    from app.engine import LLMEngine
    from app.engine.loading.dequant import QK
    from app.engine.models.layers import Linear

    model = LLMEngine(quantization="gguf").model
    layers = [m.qweight for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    head = model.lm_head_blocks
    weights: list[QBlockWeight] = layers + ([head] if head is not None else [])
    inputs = {w.in_features: torch.randn(1, w.in_features) for w in weights}

    def run_qblock() -> None:
        for w in weights:
            qblock_linear(inputs[w.in_features], w)

    int4 = []
    for w in layers:
        nb = w.in_features // QK
        pairs = w.codes.reshape(w.out_features, nb // 2, QK)
        codes = torch.stack((pairs & 15, pairs >> 4), dim=2).reshape(w.out_features, w.in_features).int()
        sz = torch.stack((w.d[:, :nb].float(), w.m[:, :nb].float()), -1).transpose(0, 1).contiguous()
        int4.append((torch._convert_weight_to_int4pack_for_cpu(codes, 8), sz.bfloat16(), w.in_features))
    xb = {k: v.bfloat16() for k, v in inputs.items()}

    def run_int4() -> None:
        for packed, sz, k in int4:
            torch._weight_int4pack_mm_for_cpu(xb[k], packed, 32, sz)

    total = sum(w.nbytes for w in weights)
    layer_bytes = sum(w.nbytes for w in layers)
    print("\n| one token's products (default model, gguf) | ms | GB/s |")
    print("|---|---|---|")
    ms = best_ms(run_qblock, repeats)
    print(f"| qblock: {len(layers)} layers + LM head ({total / 1e6:.1f} MB) | {ms:.2f} | {total / ms / 1e6:.1f} |")
    ms4 = best_ms(run_int4, repeats)
    print(f"| int4pack: the {len(layers)} layers ({layer_bytes / 1e6:.1f} MB) | {ms4:.2f} | {layer_bytes / ms4 / 1e6:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,16,64")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, qblock build: {qblock_isa()}; best of {args.repeats}, milliseconds\n")
    shapes_table([int(r) for r in args.rows.split(",")], args.repeats)
    model_table(args.repeats)


if __name__ == "__main__":
    main()
