"""Our paged Llama / GPT-2 against transformers on tiny random checkpoints loaded through our HF-folder loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine.attention import AttentionMetadata
from app.engine.loading import load_model
from tests.support.engine_models import TINY_CONFIGS, VOCAB, PagedRunner, hf_greedy

NAMES = list(TINY_CONFIGS)


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def loaded(tiny_models: dict[str, tuple[Path, Any]]) -> dict[str, Any]:
    return {name: load_model(folder)[0] for name, (folder, _) in tiny_models.items()}


@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_transformers(name: str, tiny_models: dict, loaded: dict) -> None:
    _, hf = tiny_models[name]
    model = loaded[name]
    prompt = _prompt(1, 37)
    runner = PagedRunner(model, block_size=4)
    runner._reserve(0, len(prompt))
    model.bind_kv_cache(runner.caches)
    meta = AttentionMetadata.build([37], [37], [runner.tables[0]], 4)
    hidden = model(torch.tensor(prompt), torch.arange(37), meta)
    ours = model.compute_logits(hidden)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decode_matches_generate(name: str, tiny_models: dict, loaded: dict) -> None:
    _, hf = tiny_models[name]
    prompt = _prompt(2, 11)
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 32)
    tokens, logits = PagedRunner(loaded[name], block_size=4).greedy([prompt], 32)
    assert tokens[0] == ref_tokens
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_batch_of_mixed_lengths_decodes_like_each_alone(name: str, tiny_models: dict, loaded: dict) -> None:
    """Batch invariance: six prompts of different lengths in one flat batch give each prompt's own tokens."""
    _, hf = tiny_models[name]
    prompts = [_prompt(10 + i, n) for i, n in enumerate([1, 5, 9, 17, 30, 4])]
    batched, _ = PagedRunner(loaded[name], block_size=4).greedy(prompts, 24)
    for prompt, got in zip(prompts, batched, strict=True):
        alone, _ = PagedRunner(loaded[name], block_size=4).greedy([prompt], 24)
        assert got == alone[0]
        assert got == hf_greedy(hf, prompt, 24)[0]


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_gives_same_logits(name: str, loaded: dict) -> None:
    model = loaded[name]
    prompt = _prompt(3, 29)
    whole = PagedRunner(model, block_size=4).step([(0, prompt)])
    runner = PagedRunner(model, block_size=4, seed=7)
    runner.step([(0, prompt[:13])])  # first chunk ends mid-block
    chunked = runner.step([(0, prompt[13:])])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_of_prefill_chunks_and_decodes(name: str, loaded: dict) -> None:
    """One flat batch holding a decode, a later prefill chunk and a fresh prefill equals separate runs."""
    model = loaded[name]
    a, b, c = _prompt(4, 10), _prompt(5, 20), _prompt(6, 7)
    runner = PagedRunner(model, block_size=4)
    la = runner.step([(0, a)])
    runner.step([(1, b[:8])])
    next_a = int(la.argmax(-1))
    mixed = runner.step([(0, [next_a]), (1, b[8:]), (2, c)])
    ref_a = PagedRunner(model, block_size=4).step([(0, [*a, next_a])])
    ref_b = PagedRunner(model, block_size=4).step([(0, b)])
    ref_c = PagedRunner(model, block_size=4).step([(0, c)])
    torch.testing.assert_close(mixed, torch.cat([ref_a, ref_b, ref_c]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_cached_prompt_matches_full_prefill(name: str, loaded: dict) -> None:
    """A second prompt sharing the first's full blocks computes only its suffix (query shorter than context)."""
    model = loaded[name]
    shared = _prompt(8, 12)  # exactly three blocks of 4
    first = [*shared, *_prompt(9, 5)]
    second = [*shared, *_prompt(11, 9)]
    runner = PagedRunner(model, block_size=4)
    runner.step([(0, first)])
    cached = runner.share_prefix(0, 1, num_blocks=3)
    logits = runner.step([(1, second[cached:])])
    ref = PagedRunner(model, block_size=4).step([(0, second)])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    # and it keeps decoding correctly from there
    tokens_ref, _ = PagedRunner(model, block_size=4).greedy([second], 8)
    nxt = int(logits.argmax(-1))
    got = [nxt]
    for _ in range(7):
        nxt = int(runner.step([(1, [nxt])]).argmax(-1))
        got.append(nxt)
    assert got == tokens_ref[0]


def test_metadata_rejects_inconsistent_layouts() -> None:
    with pytest.raises(ValueError, match="query_len <= context_len"):
        AttentionMetadata.build([5], [3], [[0]], 4)
    with pytest.raises(ValueError, match="needs more than"):
        AttentionMetadata.build([9], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="block tables"):
        AttentionMetadata.build([1, 1], [1, 1], [[0]], 4)


def test_forward_without_kv_cache_is_a_clear_error(tiny_models: dict) -> None:
    model, _, _ = load_model(tiny_models["gpt2"][0])
    meta = AttentionMetadata.build([2], [2], [[0]], 4)
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        model(torch.tensor([1, 2]), torch.arange(2), meta)


def test_decode_batch_split_by_context_length(loaded: dict) -> None:
    """Many decodes of very different lengths are attended in several groups; results equal each alone."""
    model = loaded["llama_gqa_llama3"]
    lengths = [1, 2, 3, 5, 8, 60, 61, 63, 4, 9, 7, 62, 6, 3, 2, 64, 1, 59, 5, 58]
    prompts = [_prompt(100 + i, n) for i, n in enumerate(lengths)]
    runner = PagedRunner(model, block_size=4)
    first = runner.step(list(enumerate(prompts)))
    nxt = first.argmax(-1).tolist()
    chunks = [(i, [t]) for i, t in enumerate(nxt)]
    batched = runner.step(chunks)
    meta = AttentionMetadata.build(
        [1] * len(lengths), [n + 1 for n in lengths], [runner.tables[i] for i in range(len(lengths))], 4
    )
    assert len(meta.decode_groups) > 1  # the step above took the grouped path
    for i, prompt in enumerate(prompts):
        alone = PagedRunner(model, block_size=4).step([(0, [*prompt, nxt[i]])])
        torch.testing.assert_close(batched[i : i + 1], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "gpt2"])
def test_bfloat16_weights_run_close_to_float32(name: str, tiny_models: dict) -> None:
    folder, _ = tiny_models[name]
    m32, _, _ = load_model(folder)
    m16, _, _ = load_model(folder, dtype=torch.bfloat16)
    assert m16.lm_head_weight().dtype == torch.bfloat16
    # on CPU only the products are bfloat16: norms, activations and the KV cache stay float32
    assert m16.compute_dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in m16.named_parameters() if "norm" in n or "ln_" in n)
    prompt = _prompt(12, 9)
    runner32, runner16 = PagedRunner(m32, block_size=4), PagedRunner(m16, block_size=4)
    l32 = runner32.step([(0, prompt)])
    l16 = runner16.step([(0, prompt)])
    assert l16.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(l32, l16).item() > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tiny_models: dict) -> None:
    from app.engine.attention import allocate_kv_cache

    folder, _ = tiny_models["llama_gqa_llama3"]
    cpu, _, cfg = load_model(folder)
    gpu, _, _ = load_model(folder, device="cuda")
    prompt = _prompt(13, 21)
    ref = PagedRunner(cpu, block_size=4).step([(0, prompt)])
    gpu.bind_kv_cache(allocate_kv_cache(cfg, 16, 4, device="cuda"))
    meta = AttentionMetadata.build([21], [21], [list(range(6))], 4, device="cuda")
    hidden = gpu(torch.tensor(prompt, device="cuda"), torch.arange(21, device="cuda"), meta)
    torch.testing.assert_close(gpu.compute_logits(hidden[-1:]).cpu(), ref, atol=1e-4, rtol=0)


def test_compute_logits_into_a_reused_buffer(loaded: dict) -> None:
    model = loaded["llama_gqa_llama3"]
    hidden = torch.randn(3, model.config.hidden_size)
    out = torch.empty(3, model.config.vocab_size)
    got = model.compute_logits(hidden, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, model.compute_logits(hidden), atol=1e-5, rtol=0)
