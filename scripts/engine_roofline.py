"""The matrix-product ceiling of the engine on this machine: the throughput decoding could reach if a step were
nothing but its matrix products (every projection of every layer and the LM head, on the real weights, through
the engine's own ``linear``), for several batch sizes.

    .venv/bin/python scripts/engine_roofline.py                 # SmolLM2, 2 threads, rows 1, 16, 64, 128
    .venv/bin/python scripts/engine_roofline.py --rows 1,64,512 --threads 2
    .venv/bin/python scripts/engine_roofline.py --rows 64 --frameworks torch,jax,jax-bfloat16,tinygrad

Compare a workload's measured tokens/s (scripts/bench_engine.py) with the ceiling at its batch size: the gap is
what attention, norms, sampling and Python cost. ``--workloads A:64:365,B:96:285,C:1:37`` (name, sequences per
step, measured tok/s) also prints, per workload, the share it reaches of this CPU's float32 and int8 roofs
(peak multiply-adds from /proc/cpuinfo: vector width, two FMA ports, the clock; int8 is four times float32 with
VNNI, twice without) and, for decoding, of the memory roof (the weights' bytes read per step against the copy
bandwidth measured here).

``--frameworks`` times the same products in each model runner's own library (issue 34), the weights streamed from
memory as in a real step: ``torch`` (the engine's ``linear``: oneDNN), ``jax`` and ``jax-bfloat16`` (the JAX runner's
``linear``, float32 or bfloat16 products: XLA's YNNPACK dots, the whole chain in one compiled call), ``tinygrad`` (the
tinygrad runner's product kernels in one TinyJit per thread, each thread a share of the rows, as the runner splits a
step). A framework's ceiling bounds what its runner can reach on a workload of that batch size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import LLMEngine
from app.engine.kernels.cpu_features import cpu_flags
from app.engine.models.layers import linear


def product_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight of every matrix product of one decode step (Llama layout), the LM head last."""
    weights: list[torch.Tensor] = []
    for layer in model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    weights.append(model.lm_head_weight())  # type: ignore[operator]
    return weights


FRAMEWORKS = ("torch", "jax", "jax-bfloat16", "tinygrad")


def torch_step(weights: list[torch.Tensor], rows: int) -> Callable[[], None]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def step() -> None:
        for w in weights:
            linear(inputs[w.shape[1]], w)

    return step


def jax_step(weights: list[torch.Tensor], rows: int, bfloat16: bool) -> Callable[[], None]:
    """Every product in one compiled call, each taking the previous one's output (cut or zero-padded to its input
    width) as its input, as a step chains them."""
    import jax
    import jax.numpy as jnp

    from app.engine.frameworks.jax.layers import linear as jax_linear

    dtype = jnp.bfloat16 if bfloat16 else jnp.float32
    stored = [jnp.asarray(w.detach().float().numpy().T).astype(dtype) for w in weights]  # [in, out], as the runner

    @jax.jit
    def chain(x: Any, ws: list[Any]) -> Any:
        for w in ws:
            x = jax_linear(_fit(x, w.shape[0], jnp), w)
        return x

    x0 = jnp.asarray(torch.randn(rows, weights[0].shape[1]).numpy())
    return lambda: chain(x0, stored).block_until_ready()


def tinygrad_step(weights: list[torch.Tensor], rows: int, threads: int) -> Callable[[], None]:
    """The chain of :func:`jax_step` through the tinygrad runner's product kernels: one TinyJit per thread over its
    share of the rows (captured here, one after the other), replayed on ``threads`` threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    from tinygrad import Tensor, TinyJit

    from app.engine.frameworks.tinygrad.layers import Linear
    from app.engine.frameworks.tinygrad.runner import in_process

    linears = [Linear(w.detach().float().numpy()) for w in weights]
    Tensor.realize(*(t for lin in linears for t in lin.tensors()))

    def chain(x: Any) -> Any:
        for lin in linears:
            x = lin(_fit(x, lin.in_features, None))
        return x.realize()

    shares = [rows // threads + (1 if i < rows % threads else 0) for i in range(threads)]
    shards = []
    for share in (s for s in shares if s):
        jit, x = TinyJit(chain), Tensor.randn(share, weights[0].shape[1]).realize()
        with in_process():
            for _ in range(3):  # TinyJit captures on its second call
                jit(x)
        shards.append((jit, x))
    pool = ThreadPoolExecutor(len(shards))

    def step() -> None:
        for future in [pool.submit(jit, x) for jit, x in shards]:
            future.result()

    return step


def _fit(x: Any, width: int, jnp: Any) -> Any:
    """``x [rows, n]`` as ``[rows, width]``: its first columns, or zero columns appended (numpy-like ``jnp``, or a
    tinygrad Tensor when None)."""
    have = int(x.shape[1])
    if have >= width:
        return x[:, :width]
    return x.pad(((0, 0), (0, width - have))) if jnp is None else jnp.pad(x, ((0, 0), (0, width - have)))


def framework_step(framework: str, weights: list[torch.Tensor], rows: int, threads: int) -> Callable[[], None]:
    """One decode step's products of ``rows`` rows in ``framework``'s library (see the module docstring)."""
    if framework == "torch":
        return torch_step(weights, rows)
    if framework in ("jax", "jax-bfloat16"):
        return jax_step(weights, rows, bfloat16=framework == "jax-bfloat16")
    if framework == "tinygrad":
        return tinygrad_step(weights, rows, threads)
    raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}; got {framework!r}")


def time_step(step: Callable[[], None], repeats: int) -> float:
    step()
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def cpu_roofs(threads: int) -> tuple[float, float, str]:
    """Peak float32 and int8 operations per second of ``threads`` cores, and how they were reckoned."""
    flags = cpu_flags()
    width = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4  # float32 lanes of one vector
    mhz = 0.0
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
        for line in info:
            if line.startswith("cpu MHz"):
                mhz = max(mhz, float(line.split(":")[1]))
    fp32 = threads * mhz * 1e6 * width * 2 * 2  # two FMA ports, two operations per multiply-add
    vnni = bool(flags & {"avx512_vnni", "avx_vnni"})
    int8 = fp32 * (4 if vnni else 2)
    kind = "VNNI" if vnni else "without VNNI"
    how = f"{threads} cores x {mhz:.0f} MHz x {width} float32 lanes x 2 FMA ports; int8 {kind} x{4 if vnni else 2}"
    return fp32, int8, how


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second of a large tensor copy (read plus write), the best of three."""
    src = torch.ones(megabytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def workload_shares(spec: str, flops: int, weight_bytes: int, threads: int) -> None:
    fp32, int8, how = cpu_roofs(threads)
    bandwidth = copy_bandwidth()
    print(f"\nroofs: float32 {fp32 / 1e9:.0f} GFLOP/s, int8 {int8 / 1e9:.0f} GOP/s ({how}); memory "
          f"{bandwidth / 1e9:.1f} GB/s (copy)")
    print("| workload | sequences | tok/s | GFLOP/s | float32 roof | int8 roof | weight bytes/s | memory roof |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for item in spec.split(","):
        name, rows, rate = item.split(":")
        tok_s, seqs = float(rate), int(rows)
        achieved = flops * tok_s
        read = weight_bytes * tok_s / seqs  # each decode step reads every weight once for all its sequences
        print(f"| {name} | {seqs} | {tok_s:.1f} | {achieved / 1e9:.1f} | {achieved / fp32:.1%} | "
              f"{achieved / int8:.1%} | {read / 1e9:.2f} GB/s | {read / bandwidth:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the torch engine's weights (torch column; jax-bfloat16 is its own column)")
    parser.add_argument("--rows", default="1,16,64,128", help="batch sizes (tokens per step), comma-separated")
    parser.add_argument("--frameworks", default="torch",
                        help=f"libraries to time the products in, comma-separated: {', '.join(FRAMEWORKS)}")
    parser.add_argument("--workloads", default=None,
                        help="measured workloads as name:sequences:tok/s, comma-separated (e.g. A:64:365,C:1:37)")
    args = parser.parse_args()
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    # torch last: its OpenMP threads spin for a while after each parallel region and slowed the jax-bfloat16 products
    # timed next in the same process from 75 to 113 ms a step (2-core AMD EPYC)
    frameworks.sort(key=lambda f: f == "torch")
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
        parser.error(f"--frameworks: unknown {', '.join(unknown)}; choose from {', '.join(FRAMEWORKS)}")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(model=args.model, num_threads=args.threads, kv_cache_memory_bytes=256 * 1024**2,
                       dtype=args.dtype, quantization="none")
    model = engine.runner.model
    if not hasattr(model, "layers") or not hasattr(model.layers[0], "mlp"):  # type: ignore[index]
        raise SystemExit("this script knows the Llama layout only")
    weights = product_weights(model)  # torch's own dtype; the other frameworks convert them to float32 themselves
    flops = sum(2 * w.shape[0] * w.shape[1] for w in weights)
    print(f"{flops / 1e6:.0f} MFLOP of matrix products per token, {args.threads} threads")
    print(f"{'framework':>13} {'rows':>6} {'step ms':>9} {'ceiling tok/s':>14} {'GFLOP/s':>9}")
    for framework in frameworks:
        for rows in (int(r) for r in args.rows.split(",") if r.strip()):
            step = framework_step(framework, weights, rows, args.threads)
            seconds = time_step(step, repeats=max(3, 300 // max(rows, 1)))
            print(f"{framework:>13} {rows:>6} {seconds * 1000:>9.2f} {rows / seconds:>14.1f} "
                  f"{flops * rows / seconds / 1e9:>9.1f}")
    if args.workloads:
        read = sum(w.numel() * w.element_size() for w in weights)
        blocks = [m.qweight for m in model.modules() if getattr(m, "qweight", None) is not None]
        if blocks:  # decode steps of few rows read the GGUF blocks instead (quantization auto or gguf)
            print(f"(the model also keeps GGUF blocks: {len(blocks)} matrices; bytes below count float32)")
        workload_shares(args.workloads, flops, read, args.threads)


if __name__ == "__main__":
    main()
