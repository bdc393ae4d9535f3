"""The engine on a CUDA GPU (issue 16): decode from CUDA graphs against eager steps and Transformers.

    # here, where the default model is installed: its config and tokenizer, no weights (a few MB)
    .venv/bin/python scripts/bench_cuda.py --write-skeleton .gpu/smollm2
    # on the GPU machine (random bfloat16 weights of that shape are written on first use, seed 0)
    python3 scripts/bench_cuda.py --model .gpu/smollm2 --json $OUT/bench_cuda.json

Columns, all bfloat16 on the same GPU in one process, taking turns workload by workload: ours replaying
decode steps from CUDA graphs (the default), ours with ``enforce_eager=True``, and Transformers ``generate``
(batches of ``--hf-batch-size`` with left padding). Workloads are bench_engine.py's (``peers/workloads.py``):
(a) 64 x 128 tokens, (b) 128 mixed, (c) one stream of 256 tokens, (d) TTFT of a 512-token prompt, (e) English
prompts. The weights are random (the shipped GGUF is not on the GPU machine); with ``ignore_eos`` every request
makes its ``max_tokens``, so speed does not depend on them. The table shows each column's best repeat.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from hf_generate import batched_generate  # noqa: E402
from workloads import (  # noqa: E402
    WORKLOADS,
    BenchRequest,
    build_workload,
    english_text,
    english_workload,
    time_workload,
    warmup_requests,
)

SKELETON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
COLUMNS = ("ours graphs", "ours eager", "transformers")


def write_skeleton(folder: Path) -> None:
    """The default model's config and tokenizer (from its converted cache), without weights."""
    from app.engine.loading import default_model_folder

    source = default_model_folder()
    folder.mkdir(parents=True, exist_ok=True)
    for name in SKELETON_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    print(f"wrote {folder}: {sorted(p.name for p in folder.iterdir())}")


def ensure_weights(folder: Path, seed: int) -> None:
    """Random bfloat16 weights of the skeleton's shape, saved once as safetensors."""
    if any(folder.glob("*.safetensors")):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def engine_runner(engine: Any) -> Any:
    from app.engine import SamplingParams

    def run(requests: list[BenchRequest]) -> tuple[float, int]:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    return run


def make_runners(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from app.engine import LLMEngine

    options = dict(
        dtype="bfloat16",
        device=args.device,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    graphed = LLMEngine(str(args.model), **options)
    eager = LLMEngine.from_loaded(
        graphed.model, graphed.tokenizer, graphed.model_config, **options, enforce_eager=True
    )
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    runners = {
        "ours graphs": engine_runner(graphed),
        "ours eager": engine_runner(eager),
        "transformers": batched_generate(hf, args.hf_batch_size, device=args.device),
    }
    return runners, {"ours graphs": graphed, "ours eager": eager}, graphed.tokenizer


def requests_of(name: str, text_ids: list[int], seed: int, repeat: int) -> list[BenchRequest]:
    if name == "e":
        return english_workload(text_ids, seed, repeat)
    return build_workload(name, seed, repeat)


def run_all(args: argparse.Namespace, names: list[str]) -> list[dict[str, Any]]:
    runners, engines, tokenizer = make_runners(args)
    text_ids = tokenizer.encode(english_text()) if "e" in names else []
    for run in runners.values():  # untimed: first kernels, allocator growth, the first graphs
        run(warmup_requests(args.seed))
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for name in names:
            requests = requests_of(name, text_ids, args.seed, repeat)
            for column, run in runners.items():
                row = time_workload(run, requests, name, column)
                row.update(engine=column, workload=name, repeat=repeat)
                rows.append(row)
                print(json.dumps(row), flush=True)
    for column, engine in engines.items():
        graphs = engine.runner.graphs
        print(
            f"{column}: {graphs.num_graphs if graphs else 0} CUDA graphs, {graphs.replays if graphs else 0} replayed steps"
        )
    return rows


def best(rows: list[dict[str, Any]], name: str, column: str) -> float | None:
    values = [
        r["ttft_s"] if name == "d" else r["tokens_per_s"]
        for r in rows
        if r["workload"] == name and r["engine"] == column
    ]
    if not values:
        return None
    return min(values) if name == "d" else max(values)


def table(rows: list[dict[str, Any]], names: list[str]) -> str:
    head = "| workload | " + " | ".join(COLUMNS) + " | graphs / eager | graphs / transformers |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for name in names:
        vals = {c: best(rows, name, c) for c in COLUMNS}
        unit = "TTFT s" if name == "d" else "tok/s"
        cells = [f"{vals[c]:.4g}" if vals[c] is not None else "-" for c in COLUMNS]

        def ratio(peer: str, vals: dict[str, float | None] = vals, name: str = name) -> str:
            ours, other = vals["ours graphs"], vals[peer]
            if not ours or not other:
                return "-"
            return f"{(other / ours if name == 'd' else ours / other):.2f}x"

        lines.append(
            f"| ({name}) {unit} | "
            + " | ".join(cells)
            + f" | {ratio('ours eager')} | {ratio('transformers')} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--write-skeleton",
        type=Path,
        default=None,
        help="write the default model's config+tokenizer here and exit",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="an HF folder (random weights are written if it has none)"
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check this script (no graphs there)")
    args = p.parse_args()
    if args.write_skeleton:
        write_skeleton(args.write_skeleton)
        return 0
    if args.model is None or not (args.model / "config.json").exists():
        print("bench_cuda: --model must be a folder with config.json (see --write-skeleton)", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    ensure_weights(args.model, args.seed)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {gpu}, torch {torch.__version__}", flush=True)
    rows = run_all(args, names)
    print(table(rows, names))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
