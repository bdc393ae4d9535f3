"""The engine benchmark's workloads (issue 3, "Benchmark"), shared by every engine that runs them.

Standard library only, so that each engine's own environment (our .venv, the vLLM venv, a Transformers
runner) imports the very same function and sees the very same prompts::

    from scripts.peers.workloads import build_workload     # from the repo root
    # or: sys.path.insert(0, "scripts/peers"); from workloads import build_workload

Prompts are **token-id lists**, not text: every engine gets the exact same tokens with the exact same
lengths, and no tokenizer round trip can change a length. The ids are drawn uniformly from ``[VOCAB_LOW,
VOCAB_HIGH)`` = ``[1000, 48000)``, ordinary BPE tokens of SmolLM2's 49,152-token vocabulary (ids 0-16 are its
special tokens, 17-272 single bytes); no special token is ever drawn. Each workload has its own random
stream, ``random.Random(f"inf-engine-bench/{name}/{seed}")`` (string seeds are hashed with SHA-512, so the
draws are identical on every platform and Python 3 version), in a fixed order: for each request, first its
prompt length, then its output length, then its prompt ids.

Every request is run greedily (temperature 0) with ``ignore_eos`` so that each engine produces exactly
``max_tokens`` tokens and the useful output token count is the same everywhere.

=====  ==========================================================================================
 a     64 requests, prompt 32 tokens each, 128 new tokens each (8,192 output tokens)
 b     128 requests, prompt length uniform in [16, 512], output length uniform in [16, 256]
 c     1 request, prompt 32 tokens, 256 new tokens: single-stream decode
 d     3 requests, prompt 512 tokens, 1 new token: TTFT, one request per timed call (3 repeats, median).
       Three *different* prompts, so a prefix cache cannot serve a repeat.
 e     96 mixed English prompts, 20-600 tokens each, 16-200 new tokens each (issue 16's workload B)
=====  ==========================================================================================

Workload (e) is the one exception to random ids: its prompts are windows of English text, the prose of the
repository's own ``README.md`` and ``deploy/README.md`` (fenced code blocks and table rows left out; see
:func:`english_text`) plus the example reviews of ``app/examples/reviews.jsonl``, tokenized by SmolLM2's
tokenizer. Tokenizing needs a tokenizer, which this module (standard library only) does not have: the driver
(``bench_engine.py``, in our venv) tokenizes :func:`english_text` once with ``add_special_tokens=False``,
writes the ids to a JSON file (:func:`write_text_ids`) and names it in the environment variable
``INF_BENCH_TEXT_IDS``, which every engine's worker inherits and reads here, so every engine gets the very
same ids. Each request takes, in order from its own stream, a prompt length, an output length and a start
offset into the tokenized text; a repeat > 0 keeps the lengths and draws other offsets (the prompts are still
English, and a prefix cache cannot serve a repeat). The text changes when the READMEs do, so compare (e)
figures within one run only.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_LOW = 1000
VOCAB_HIGH = 48000

WORKLOADS = ("a", "b", "c", "d", "e")

A_REQUESTS, A_PROMPT_LEN, A_MAX_TOKENS = 64, 32, 128
B_REQUESTS, B_PROMPT_RANGE, B_OUTPUT_RANGE = 128, (16, 512), (16, 256)
C_PROMPT_LEN, C_MAX_TOKENS = 32, 256
D_REPEATS, D_PROMPT_LEN, D_MAX_TOKENS = 3, 512, 1
E_REQUESTS, E_PROMPT_RANGE, E_OUTPUT_RANGE = 96, (20, 600), (16, 200)
TEXT_IDS_ENV = "INF_BENCH_TEXT_IDS"
ROOT = Path(__file__).resolve().parents[2]
ENGLISH_SOURCES = ("README.md", "deploy/README.md", "app/examples/reviews.jsonl")

DESCRIPTIONS = {
    "a": f"{A_REQUESTS} prompts x {A_MAX_TOKENS} new tokens (prompt {A_PROMPT_LEN})",
    "b": f"{B_REQUESTS} requests, prompt {B_PROMPT_RANGE[0]}-{B_PROMPT_RANGE[1]}, "
    f"output {B_OUTPUT_RANGE[0]}-{B_OUTPUT_RANGE[1]}",
    "c": f"single stream, {C_MAX_TOKENS} new tokens (prompt {C_PROMPT_LEN})",
    "d": f"TTFT of a {D_PROMPT_LEN}-token prompt (median of {D_REPEATS})",
    "e": f"{E_REQUESTS} mixed English prompts, {E_PROMPT_RANGE[0]}-{E_PROMPT_RANGE[1]} tokens, "
    f"output {E_OUTPUT_RANGE[0]}-{E_OUTPUT_RANGE[1]}",
}


@dataclass(frozen=True)
class BenchRequest:
    """One request: the prompt as token ids and the exact number of tokens to generate (ignore_eos)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _rng(name: str, seed: int) -> random.Random:
    return random.Random(f"inf-engine-bench/{name}/{seed}")


def random_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length))


def build_workload(name: str, seed: int = 0, repeat: int = 0) -> list[BenchRequest]:
    """The requests of workload ``name`` ("a", "b", "c" or "d") for ``seed``; deterministic.

    ``repeat`` > 0 gives the same workload (same lengths, same kind of random prompts) with other token ids, so
    that a repeated measurement in the same engine process cannot be served from its prefix cache.
    """
    rng = _rng(name, seed)
    if name == "a":
        out = [BenchRequest(random_prompt(rng, A_PROMPT_LEN), A_MAX_TOKENS) for _ in range(A_REQUESTS)]
    elif name == "b":
        out = []
        for _ in range(B_REQUESTS):
            prompt_len = rng.randint(*B_PROMPT_RANGE)
            max_tokens = rng.randint(*B_OUTPUT_RANGE)
            out.append(BenchRequest(random_prompt(rng, prompt_len), max_tokens))
    elif name == "c":
        out = [BenchRequest(random_prompt(rng, C_PROMPT_LEN), C_MAX_TOKENS)]
    elif name == "d":
        out = [BenchRequest(random_prompt(rng, D_PROMPT_LEN), D_MAX_TOKENS) for _ in range(D_REPEATS)]
    elif name == "e":
        return english_workload(read_text_ids(), seed, repeat)
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    return [_shifted(r, repeat) for r in out] if repeat else out


def _shifted(request: BenchRequest, repeat: int) -> BenchRequest:
    """Every prompt id moved by a repeat-dependent offset, wrapping inside [VOCAB_LOW, VOCAB_HIGH)."""
    span = VOCAB_HIGH - VOCAB_LOW
    offset = (7919 * repeat) % span or 1
    ids = tuple(VOCAB_LOW + (t - VOCAB_LOW + offset) % span for t in request.prompt_token_ids)
    return BenchRequest(ids, request.max_tokens)


def english_workload(text_ids: list[int], seed: int = 0, repeat: int = 0) -> list[BenchRequest]:
    """Workload (e) over the tokenized English text ``text_ids``: windows of it as prompts."""
    if len(text_ids) <= E_PROMPT_RANGE[1]:
        raise ValueError(
            f"the English text has {len(text_ids)} tokens; (e) needs more than {E_PROMPT_RANGE[1]}"
        )
    rng = _rng("e", seed)
    lengths = [(rng.randint(*E_PROMPT_RANGE), rng.randint(*E_OUTPUT_RANGE)) for _ in range(E_REQUESTS)]
    starts = _rng(f"e-offsets-{repeat}", seed)
    out = []
    for prompt_len, max_tokens in lengths:
        start = starts.randrange(len(text_ids) - prompt_len + 1)
        out.append(BenchRequest(tuple(text_ids[start : start + prompt_len]), max_tokens))
    return out


def english_text(root: Path = ROOT) -> str:
    """The English text of workload (e): the prose of the READMEs and the example reviews, in a fixed order."""
    parts = []
    for rel in ENGLISH_SOURCES:
        path = root / rel
        if path.suffix == ".jsonl":  # the example reviews: one {"input": {"review": ...}} per line
            lines = path.read_text(encoding="utf-8").splitlines()
            parts.append("\n".join(json.loads(line)["input"]["review"] for line in lines if line.strip()))
            continue
        kept, fenced = [], False
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and not line.lstrip().startswith("|"):
                kept.append(line)
        parts.append("\n".join(kept))
    return "\n\n".join(parts)


def write_text_ids(path: Path, ids: list[int]) -> None:
    """Store the tokenized English text where :func:`read_text_ids` (in any engine's process) finds it."""
    path.write_text(json.dumps({"sources": list(ENGLISH_SOURCES), "ids": ids}), encoding="utf-8")


def read_text_ids() -> list[int]:
    """The tokenized English text named by ``$INF_BENCH_TEXT_IDS`` (written by the benchmark driver)."""
    name = os.environ.get(TEXT_IDS_ENV)
    if not name:
        raise RuntimeError(
            f"workload (e) needs ${TEXT_IDS_ENV}: a JSON file of the tokenized English text "
            "(bench_engine.py writes it; see workloads.py)"
        )
    return [int(i) for i in json.loads(Path(name).read_text(encoding="utf-8"))["ids"]]


def warmup_requests(seed: int = 0) -> list[BenchRequest]:
    """A few small requests to run (untimed) before the workloads; distinct from every workload's prompts."""
    rng = _rng("warmup", seed)
    return [BenchRequest(random_prompt(rng, n), 8) for n in (16, 64, 200, 40)]


def available_workloads() -> tuple[str, ...]:
    """Every workload whose inputs are at hand: (e) only where ``$INF_BENCH_TEXT_IDS`` names its text."""
    return tuple(w for w in WORKLOADS if w != "e" or os.environ.get(TEXT_IDS_ENV))


def summary(name: str, seed: int = 0) -> dict[str, int]:
    """Request count and prompt/output token totals of a workload (for checking replications)."""
    reqs = build_workload(name, seed)
    return {
        "requests": len(reqs),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "output_tokens": sum(r.max_tokens for r in reqs),
    }


if __name__ == "__main__":
    for w in available_workloads():
        print(json.dumps({"workload": w, "description": DESCRIPTIONS[w], **summary(w)}))


def time_workload(
    run: Callable[[list[BenchRequest]], tuple[float, int]],
    requests: list[BenchRequest],
    name: str,
    label: str,
) -> dict[str, Any]:
    """The timing fields of a workload's row, the same procedure for every engine: (d) one call per prompt,
    the median TTFT; the others one call for all requests, tokens per second (and a warning on stderr when the
    engine produced another number of tokens than asked)."""
    if name == "d":
        runs = [run([r]) for r in requests]  # one call per repeat, each a fresh prompt
        ttft = statistics.median(s for s, _ in runs)
        return {
            "output_tokens": sum(n for _, n in runs),
            "seconds": round(ttft, 4),
            "tokens_per_s": round(1 / ttft, 3),
            "ttft_s": round(ttft, 4),
            "ttft_runs_s": [round(s, 4) for s, _ in runs],
            "prefill_tokens_per_s": round(len(requests[0].prompt_token_ids) / ttft, 1),
        }
    seconds, produced = run(requests)
    expected = sum(r.max_tokens for r in requests)
    if produced != expected:
        print(f"{label}: {name}: produced {produced} tokens, expected {expected}", file=sys.stderr)
    return {
        "output_tokens": produced,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(produced / seconds, 2),
        "ttft_s": None,
    }
