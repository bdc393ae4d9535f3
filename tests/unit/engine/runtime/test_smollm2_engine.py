"""``LLMEngine()`` on the default model (SmolLM2-135M-Instruct) against transformers on the same weights.

The reference is transformers' ``LlamaForCausalLM`` loaded from the converted-model cache folder (our
dequantised GGUF weights saved as an ordinary HF folder); tests/unit/engine/models/test_smollm2.py checks
those weights against independent dequantisation.
"""

from __future__ import annotations

import pytest
import torch

from app.engine import LLMEngine, SamplingParams
from tests.support.engine_models import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 32


@pytest.mark.slow
def test_default_engine_greedy_matches_transformers() -> None:
    from app.engine.loading import cache, default_model_path

    try:
        source = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    from transformers import LlamaForCausalLM

    # the default model through the default converted cache; float32 (auto picks bfloat16 on AVX512-BF16) and
    # no blocks for few-row steps (auto keeps the file's Q4 blocks for those elsewhere), the precision in which we
    # are token-exact with Transformers
    engine = LLMEngine(dtype="float32", quantization="none")
    entry = cache.lookup(source, cache.default_cache_root())
    assert entry is not None, "LLMEngine() should have written or used the converted cache"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    hf = LlamaForCausalLM.from_pretrained(entry, dtype=torch.float32).eval()
    for output in outputs:
        ref, _ = hf_greedy(hf, output.prompt_token_ids, NEW_TOKENS)
        assert output.outputs[0].token_ids == ref
    assert "Paris" in outputs[0].outputs[0].text
    # Stopping on the model's own eos (<|im_end|>) ends a chat turn with finish_reason "stop".
    [short] = engine.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=64)
    )
    assert short.outputs[0].finish_reason == "stop" and short.outputs[0].token_ids[-1] == engine.eos_token_id
