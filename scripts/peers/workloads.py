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
=====  ==========================================================================================
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_LOW = 1000
VOCAB_HIGH = 48000

WORKLOADS = ("a", "b", "c", "d")

A_REQUESTS, A_PROMPT_LEN, A_MAX_TOKENS = 64, 32, 128
B_REQUESTS, B_PROMPT_RANGE, B_OUTPUT_RANGE = 128, (16, 512), (16, 256)
C_PROMPT_LEN, C_MAX_TOKENS = 32, 256
D_REPEATS, D_PROMPT_LEN, D_MAX_TOKENS = 3, 512, 1

DESCRIPTIONS = {
    "a": f"{A_REQUESTS} prompts x {A_MAX_TOKENS} new tokens (prompt {A_PROMPT_LEN})",
    "b": f"{B_REQUESTS} requests, prompt {B_PROMPT_RANGE[0]}-{B_PROMPT_RANGE[1]}, "
    f"output {B_OUTPUT_RANGE[0]}-{B_OUTPUT_RANGE[1]}",
    "c": f"single stream, {C_MAX_TOKENS} new tokens (prompt {C_PROMPT_LEN})",
    "d": f"TTFT of a {D_PROMPT_LEN}-token prompt (median of {D_REPEATS})",
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
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    return [_shifted(r, repeat) for r in out] if repeat else out


def _shifted(request: BenchRequest, repeat: int) -> BenchRequest:
    """Every prompt id moved by a repeat-dependent offset, wrapping inside [VOCAB_LOW, VOCAB_HIGH)."""
    span = VOCAB_HIGH - VOCAB_LOW
    offset = (7919 * repeat) % span or 1
    ids = tuple(VOCAB_LOW + (t - VOCAB_LOW + offset) % span for t in request.prompt_token_ids)
    return BenchRequest(ids, request.max_tokens)


def warmup_requests(seed: int = 0) -> list[BenchRequest]:
    """A few small requests to run (untimed) before the workloads; distinct from every workload's prompts."""
    rng = _rng("warmup", seed)
    return [BenchRequest(random_prompt(rng, n), 8) for n in (16, 64, 200, 40)]


def summary(name: str, seed: int = 0) -> dict[str, int]:
    """Request count and prompt/output token totals of a workload (for checking replications)."""
    reqs = build_workload(name, seed)
    return {
        "requests": len(reqs),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "output_tokens": sum(r.max_tokens for r in reqs),
    }


if __name__ == "__main__":
    import json

    for w in WORKLOADS:
        print(json.dumps({"workload": w, "description": DESCRIPTIONS[w], **summary(w)}))
