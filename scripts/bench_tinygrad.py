"""The tinygrad runner (issue 34) against the torch runner, Transformers ``generate`` and tinygrad's own
``tinygrad.llm``, on the default SmolLM2-135M-Instruct (float32, CPU). One engine per process, one measurement per
command::

    .venv/bin/python scripts/bench_tinygrad.py a --engine tinygrad       # workload A: 64 prompts x 128 new tokens
    .venv/bin/python scripts/bench_tinygrad.py a --engine torch          # (dtype float32, no quantization)
    .venv/bin/python scripts/bench_tinygrad.py a --engine jax            # the JAX runner, the same engine core
    .venv/bin/python scripts/bench_tinygrad.py a --engine jax --dtype bfloat16   # its bfloat16 products
    .venv/bin/python scripts/bench_tinygrad.py a --engine transformers   # generate, batch 64, left padding
    .venv/bin/python scripts/bench_tinygrad.py single --engine tinygrad  # one stream: decode tok/s
    .venv/bin/python scripts/bench_tinygrad.py single --engine tinygrad.llm

Workload A is scripts/peers/workloads.py's (random ids, greedy, ``ignore_eos``), after an untimed warmup; each
repeat draws other prompts (``build_workload(..., repeat=i)``), so a prefix cache cannot serve a repeat. ``single``
times each decoded token of one 32-token prompt and reports the steady state (tokens 9..N). tinygrad.llm runs on the
same GGUF file; tinygrad 0.14's wheel lacks its ``tinygrad.llm.kernels`` package (AMD kernels), so a stand-in
module gives it plain ``nn.Linear`` (what it uses on a CPU anyway). Lines report wall and CPU seconds and the load
average: on a shared machine, compare runs made under the same load.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from workloads import BenchRequest, build_workload, warmup_requests  # noqa: E402

Runner = Callable[[list[BenchRequest]], tuple[float, int]]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def engine_runner(framework: str, dtype: str) -> tuple[Runner, Callable[[], str]]:
    from app.engine import LLMEngine, SamplingParams

    options: dict[str, object] = dict(framework=framework, max_model_len=1024, kv_cache_memory_bytes=1 << 30, seed=0,
                                      dtype=dtype)
    if framework == "torch":
        options.update(quantization="none", num_threads=2)
    engine = LLMEngine(**options)  # type: ignore[arg-type]

    def run(requests: list[BenchRequest]) -> tuple[float, int]:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    def info() -> str:
        return f"compilations {getattr(engine.runner, 'num_compilations', '-')}"

    return run, info


def transformers_runner(dtype: str) -> tuple[Runner, Callable[[], str]]:
    import torch
    from hf_generate import batched_generate
    from transformers import AutoModelForCausalLM

    from app.engine.loading import default_model_folder

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(default_model_folder(), dtype=getattr(torch, dtype)).eval()
    return batched_generate(model, 64), lambda: f"threads 2, batch 64, {dtype}"


def workload_a(engine: str, repeats: int, dtype: str) -> None:
    run, info = transformers_runner(dtype) if engine == "transformers" else engine_runner(engine, dtype)
    run(warmup_requests(0))
    for repeat in range(repeats):
        load, cpu = os.getloadavg()[0], cpu_seconds()
        seconds, tokens = run(build_workload("a", 0, repeat))
        print(f"{engine} workload A: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s, CPU "
              f"{cpu_seconds() - cpu:.1f} s, load {load:.2f} -> {os.getloadavg()[0]:.2f}, {info()}", flush=True)


def tinygrad_llm_stream(prompt: list[int]) -> Callable[[], int]:
    """tinygrad.llm's generator over the default GGUF (see the module docstring for the kernels stand-in)."""
    from tinygrad_llm_offline import kernels_stand_in

    kernels_stand_in()
    from tinygrad.llm.model import Transformer

    from app.engine.loading import default_model_path

    model, _ = Transformer.from_gguf(default_model_path(), 1024)
    generator = model.generate(list(prompt))
    return lambda: next(generator)


def single_stream(engine: str, new_tokens: int, dtype: str) -> None:
    [request] = build_workload("c", 0)
    prompt = list(request.prompt_token_ids)
    if engine == "tinygrad.llm":
        step = tinygrad_llm_stream(prompt)
    else:
        from app.engine import LLMEngine, SamplingParams

        options: dict[str, object] = dict(framework=engine, max_model_len=1024, seed=0, dtype=dtype)
        if engine == "torch":
            options.update(quantization="none", num_threads=2)
        llm = LLMEngine(**options)  # type: ignore[arg-type]
        llm.add_request("single", prompt_token_ids=prompt,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True))

        def step() -> int:
            llm.step()
            return 0

    times = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    steady = times[8:]
    print(f"{engine} single stream: first step {times[0] * 1e3:.0f} ms, steady decode "
          f"{len(steady) / sum(steady):.1f} tok/s over {len(steady)} tokens, load {os.getloadavg()[0]:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("a", "single"))
    parser.add_argument("--engine", default="tinygrad", choices=("tinygrad", "jax", "torch", "transformers", "tinygrad.llm"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="single: tokens to decode")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the engine's dtype (jax: bfloat16 products; tinygrad refuses bfloat16) or, in a, transformers' weights")
    args = parser.parse_args()
    if args.what == "a":
        workload_a(args.engine, args.repeats, args.dtype)
    else:
        single_stream(args.engine, args.tokens, args.dtype)


if __name__ == "__main__":
    main()
