"""Our embedding encoder against sentence-transformers on the packaged all-MiniLM-L6-v2 (goal: 1.5x or more).

    .venv/bin/python scripts/bench_embeddings.py                       # 10,000 short texts, batch 32, 2 threads
    .venv/bin/python scripts/bench_embeddings.py --count 2000 --chunk 250 --threads 1
    .venv/bin/python scripts/bench_embeddings.py --dtype bfloat16              # our bfloat16 products

Both run in this process on the same texts, at the same batch size (sentence-transformers' ``encode`` batch,
our group size) and thread count, texts in and float32 vectors out (tokenising counted for both). They take
turns of ``--chunk`` texts (each call sorts its texts by length), so the busy phases of a machine others share
hit both alike. The texts are the sentences of the reviews in app/examples (no download), cycled with a counter
suffix.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.engine.embedding import EmbeddingModel, resolve_embedding_model  # noqa: E402

EXAMPLES = ROOT / "app" / "examples"


def review_texts() -> list[str]:
    """The reviews of app/examples: sentiment_*.jsonl's ``input`` and reviews.jsonl's ``input.review``."""
    texts: list[str] = []
    for path in sorted(EXAMPLES.glob("sentiment_*.jsonl")) + [EXAMPLES / "reviews.jsonl"]:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            value = json.loads(line)["input"]
            texts.append(value["review"] if isinstance(value, dict) else value)
    return texts


def short_texts(count: int) -> list[str]:
    """``count`` short texts, deterministic: the reviews' sentences in turn, each with a counter suffix."""
    sentences = [s for text in review_texts() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    return [f"{sentence} ({n})" for n, sentence in zip(range(count), itertools.cycle(sentences))]


def cpu_line() -> str:
    """The CPU's model name and its vector flags, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return "CPU: unknown (no /proc/cpuinfo)"
    name = next((line.partition(":")[2].strip() for line in info if line.startswith("model name")), "unknown")
    flags = set(next((line.partition(":")[2].split() for line in info if line.startswith("flags")), []))
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile")
    shown = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)
    return f"CPU: {name}; {shown}"


def compare(runs: dict[str, Callable[[list[str]], torch.Tensor]], texts: list[str], chunk: int,
            repeat: int) -> tuple[dict[str, float], list[float], dict[str, torch.Tensor]]:
    """Each engine's seconds over ``repeat`` passes of ``texts``, taken in chunks the engines run in turn (the
    first swapping every chunk), so both see the same phases of a machine others share; the per-chunk ratios
    (first over second engine's rate); the vectors of the last pass."""
    seconds = dict.fromkeys(runs, 0.0)
    ratios: list[float] = []
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeat):
        outs = {name: [] for name in runs}
        for c, start in enumerate(range(0, len(texts), chunk)):
            part = texts[start:start + chunk]
            took = {}
            for name in names if (r + c) % 2 == 0 else names[::-1]:
                started = time.perf_counter()
                outs[name].append(runs[name](part))
                took[name] = time.perf_counter() - started
                seconds[name] += took[name]
            ratios.append(took[names[1]] / took[names[0]])
    return seconds, ratios, {name: torch.cat(parts) for name, parts in outs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000, help="texts to embed")
    parser.add_argument("--batch-size", type=int, default=32, help="encode's batch size and our group size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="our products' dtype (bfloat16: CPUs with AVX512-BF16 or AMX); theirs stays float32")
    parser.add_argument("--chunk", type=int, default=1000, help="texts per call; the engines take turns")
    parser.add_argument("--repeat", type=int, default=1, help="passes over all texts")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer  # the peer, only here (a dev dependency)

    ours = EmbeddingModel.load("all-MiniLM-L6-v2", num_threads=args.threads, dtype=args.dtype)
    ours.max_batch_sequences = args.batch_size
    peer = SentenceTransformer(str(resolve_embedding_model("all-MiniLM-L6-v2")), device="cpu")
    texts = short_texts(args.count)
    tokens = sum(len(ids) for ids in ours.tokenize(texts))
    runs: dict[str, Callable[[list[str]], torch.Tensor]] = {
        "ours": lambda part: ours.embed(ours.tokenize(part)),
        "sentence-transformers": lambda part: peer.encode(
            part, batch_size=args.batch_size, convert_to_tensor=True, show_progress_bar=False).float().cpu(),
    }
    for run in runs.values():
        run(texts[:256])  # warm up (oneDNN's kernels, the allocator)
    seconds, ratios, outs = compare(runs, texts, args.chunk, args.repeat)
    rates = {name: len(texts) * args.repeat / s for name, s in seconds.items()}
    cos = torch.nn.functional.cosine_similarity(outs["ours"], outs["sentence-transformers"], dim=1)
    print(cpu_line())
    print(f"torch {torch.__version__}, ours in {args.dtype}, {args.threads} threads, {len(texts)} texts ({tokens / len(texts):.1f} tokens "
          f"each on average, with [CLS]/[SEP]), batch size {args.batch_size}, in turns of {args.chunk} texts, "
          f"{args.repeat} pass(es)\n")
    print("| engine | texts/s | vs sentence-transformers |")
    print("|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.1f} | {rate / rates['sentence-transformers']:.2f}x |")
    print(f"\nper-turn speedup of ours: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}x to "
          f"{max(ratios):.2f}x over {len(ratios)} turns")
    print(f"cosine ours vs sentence-transformers over all {len(texts)} texts: min {cos.min().item():.7f}, "
          f"mean {cos.mean().item():.7f}")


if __name__ == "__main__":
    main()
