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


#: llama.cpp's greedy answers on the same Q4_1 file (llama-cpp-python 0.3.36, ``create_chat_completion``,
#: temperature 0, 20 tokens; run by hand with .venv-llamacpp, see scripts/setup_llamacpp.sh)
LLAMACPP_Q4_1 = {
    "What is the capital of France?": "L'Étoile, la Cité, la Nation, la Géologie, la Culture",
    "Say hello.": "Hello! I'm here to help with any kind of creative writing project. What can I help you",
}


@pytest.mark.slow
def test_the_files_own_blocks_answer_as_llama_cpp_does() -> None:
    """``quantization="gguf"`` runs the file's Q4_1 blocks (and its Q8_0 head), as llama.cpp does. SmolLM2 in
    Q4_1 answers the capital question with French landmarks instead of "Paris", and so does llama.cpp on the same
    file: that answer is the quantized model's, not a defect of our blocks or head. The two agree token for token
    until a near-tie (both quantize the activations per block of 32, in different kernels); here, on AVX512-BF16,
    both 20-token answers to "Say hello." are equal."""
    try:
        from app.engine.loading import default_model_path

        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    engine = LLMEngine(dtype="float32", quantization="gguf")
    params = SamplingParams(temperature=0.0, max_tokens=20)
    france, hello = engine.chat([[{"role": "user", "content": q}] for q in LLAMACPP_Q4_1], params)
    # the first words only: the kernels differ per CPU class (AVX2, AVX-512, AVX512-BF16), and so may a late tie
    assert france.outputs[0].text.startswith("L'Étoile, la ")
    assert hello.outputs[0].text.startswith("Hello! I'm here to help with any kind of creative writing")
