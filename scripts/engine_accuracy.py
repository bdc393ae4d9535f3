"""Accuracy of the engine's precisions on SmolLM2: greedy agreement with Transformers and perplexity.

    .venv/bin/python scripts/engine_accuracy.py                  # float32, bfloat16, bfloat16+int8
    .venv/bin/python scripts/engine_accuracy.py --modes bfloat16 --prompts 4 --tokens 32

For each mode (``dtype[+quantization]``) of our engine, on the default model:

* **Agreement**: 16 chat prompts, 64 greedy tokens each (``ignore_eos``), against Transformers'
  ``generate`` in the same precision (float32 for float32 and for int8, whose reference is the float weights
  it quantizes; bfloat16 for bfloat16, Transformers' own all-bfloat16 forward). Reported: the share of the
  64 x 16 tokens produced before each prompt's first divergence, and the share of equal positions.
* **Perplexity** of the shipped English text (``scripts/peers/workloads.english_text``: the READMEs' prose
  and the example reviews), its first ``--ppl-tokens`` tokens teacher-forced in one prefill, ours and
  Transformers' in the same precision; the issue's bounds are within 1% (bfloat16), 3% (int8) and 6%
  (4-bit) of float32.

Prints a markdown table; figures are measured in this run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from workloads import english_text  # noqa: E402

from app.engine import LLMEngine, SamplingParams  # noqa: E402
from app.engine.attention import AttentionMetadata  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "Give me a tip for learning a language.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "What is 17 times 3? Explain.",
    "Summarize the plot of Cinderella.",
    "What are the benefits of exercise?",
    "Translate 'good morning' into Spanish and French.",
    "Write a short thank-you note to a teacher.",
    "What is the difference between weather and climate?",
    "Suggest a name for a coffee shop.",
]


def parse_mode(mode: str) -> tuple[str, str | None]:
    dtype, _, quant = mode.partition("+")
    return dtype, quant or None


def our_perplexity(engine: LLMEngine, ids: list[int]) -> float:
    """Teacher-forced perplexity of ``ids`` in one prefill on the engine's own model and KV cache."""
    runner = engine.runner
    block = runner.block_size
    table = list(range(-(-len(ids) // block)))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], block)
    model = runner.model
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta)
        logits = model.compute_logits(hidden).float()
    return _ppl(logits, ids)


def _ppl(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def hf_model(dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    from app.engine.loading import default_model_folder

    return LlamaForCausalLM.from_pretrained(default_model_folder(), dtype=dtype).eval()


def hf_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_perplexity(model: Any, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return _ppl(logits, ids)


def agreement(ours: list[list[int]], refs: list[list[int]]) -> tuple[float, float]:
    total = sum(len(r) for r in refs)
    prefix = 0
    for a, b in zip(ours, refs, strict=True):
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            prefix += 1
    equal = sum(x == y for a, b in zip(ours, refs, strict=True) for x, y in zip(a, b, strict=False))
    return prefix / total, equal / total


def measure(mode: str, args: argparse.Namespace, hf_cache: dict[torch.dtype, Any]) -> dict[str, Any]:
    dtype, quant = parse_mode(mode)
    t0 = time.perf_counter()
    engine = LLMEngine(dtype=dtype, quantization=quant, num_threads=args.threads, enable_prefix_caching=False)
    tok = engine.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS[: args.prompts]
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    text_ids = tok.encode(english_text(), add_special_tokens=False)[: args.ppl_tokens]
    ppl = our_perplexity(engine, text_ids)
    ref_dtype = torch.bfloat16 if dtype == "bfloat16" and quant is None else torch.float32
    if ref_dtype not in hf_cache:
        hf_cache[ref_dtype] = hf_model(ref_dtype)
    hf = hf_cache[ref_dtype]
    refs = [hf_greedy(hf, p, args.tokens) for p in prompts]
    prefix, equal = agreement(ours, refs)
    return {
        "mode": mode,
        "reference": f"transformers {str(ref_dtype).removeprefix('torch.')}",
        "prefix": prefix,
        "equal": equal,
        "ppl": ppl,
        "hf_ppl": hf_perplexity(hf, text_ids),
        "tokens": len(text_ids),
        "seconds": time.perf_counter() - t0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="float32,bfloat16,bfloat16+int8")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    hf_cache: dict[torch.dtype, Any] = {}
    rows = [measure(m.strip(), args, hf_cache) for m in args.modes.split(",") if m.strip()]
    base = next((r["ppl"] for r in rows if r["mode"] == "float32"), None)
    print(
        f"\nSmolLM2-135M-Instruct, {args.prompts} prompts x {args.tokens} greedy tokens, "
        f"perplexity over {rows[0]['tokens']} tokens of shipped English text\n"
    )
    print(
        "| mode | reference | tokens before first divergence | equal positions | perplexity (ours) "
        "| vs our float32 | perplexity (reference) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs = f"{(r['ppl'] / base - 1) * 100:+.2f}%" if base else "-"
        print(
            f"| {r['mode']} | {r['reference']} | {r['prefix']:.1%} | {r['equal']:.1%} | {r['ppl']:.3f} "
            f"| {vs} | {r['hf_ppl']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
