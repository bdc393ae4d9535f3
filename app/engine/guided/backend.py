"""Compiling ``StructuredOutputsParams`` into xgrammar grammars, behind a bounded LRU cache.

:class:`GrammarCompiler` turns one request's structured-output spec into a ``CompiledGrammar`` (the token-level
automaton for the engine's vocabulary). Compiling costs from ~1 ms (a small schema) to ~0.5 s (a large one)
on the CPU, so the result is cached by the spec's canonical text: the same schema is compiled once, and the
cache is an LRU bounded both by entries and by the bytes xgrammar reports for the compiled grammars.

Every problem is a ``ValueError`` naming the field (``structured_outputs.json: ...``): a spec larger than
``max_spec_bytes`` (64 KiB by default) as text, a schema, regex or grammar xgrammar cannot compile. The engine
compiles in ``add_request``, so a bad request fails there and changes nothing. xgrammar drops the GIL while
it compiles (measured: another Python thread keeps ~99% of its speed), so ``AsyncEngine`` compiles on a
worker thread while the step loop goes on. Thread-safe: the cache is locked, compiles run outside the lock.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from app.engine.core.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from app.engine.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CACHE_SIZE",
    "MAX_SPEC_BYTES",
    "GrammarCompiler",
    "grammar_key",
    "xgrammar_tokenizer_info",
]

MAX_SPEC_BYTES = 64 * 1024  # a spec (schema, regex, grammar, choices) longer than this as text is refused
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept
DEFAULT_CACHE_BYTES = 512 << 20  # and at most this much memory for them (xgrammar's own accounting)

GrammarKey = tuple[str, str]


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # the engine runs without it; only structured outputs need it
        raise ValueError(
            "structured_outputs needs the 'xgrammar' package (pip install 'inf-engine[engine]')"
        ) from exc
    return xgrammar


def xgrammar_tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Seq[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the engine's tokenizer: one entry per logits column (``vocab_size``, the model's),
    the vocabulary type and prefix-space rule detected from the tokenizer JSON (as xgrammar's own
    ``from_huggingface`` does for fast tokenizers), and ``stop_token_ids`` as the grammar's end tokens.

    Special tokens other than the stop tokens are blanked: xgrammar would otherwise read ``<|im_start|>`` as
    ordinary text and allow it inside a JSON string (measured on SmolLM2), where detokenising with
    ``skip_special_tokens`` would silently drop it from the output. Blank entries are never allowed.
    """
    xgr = _import_xgrammar()
    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    stops = {int(t) for t in stop_token_ids}
    for index, added in backend.get_added_tokens_decoder().items():
        if added.special and index < vocab_size and index not in stops:
            encoded[index] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=sorted(stops) or None,
        add_prefix_space=meta["add_prefix_space"],
    )


def _ebnf_literal(text: str) -> str:
    """A GBNF string literal: JSON's escaping (quotes, backslashes, control characters) is valid GBNF."""
    return json.dumps(text, ensure_ascii=False)


def _structural_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """Our ``{"triggers": [...], "structures": [{"begin", "schema", "end"}]}`` as xgrammar's structural tag
    (a ``triggered_tags`` format); a dict already in xgrammar's form (``"type": "structural_tag"``) as is."""
    if spec.get("type") == "structural_tag":
        return spec
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": list(spec["triggers"]),
            "tags": [
                {
                    "type": "tag",
                    "begin": s["begin"],
                    "content": {
                        "type": "json_schema",
                        "json_schema": bounded_strings_as_patterns(s["schema"]),
                    },
                    "end": s["end"],
                }
                for s in spec["structures"]
            ],
        },
    }


# A regex class: any character but a quote, a backslash, a control character or a UTF-16 surrogate (which
# xgrammar would otherwise take as a 3-byte UTF-8 sequence, invalid UTF-8 that decodes to three U+FFFD).
_STRING_CHAR = r'[^"\\\x00-\x1f\ud800-\udfff]'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` (a copy) with every ``{"type": "string"}`` bounded by ``minLength``/``maxLength`` (and no
    ``pattern``, ``format``, ``enum`` or ``const``) given the equivalent ``pattern`` instead.

    A workaround for xgrammar 0.2.8, which compiles length-bounded strings to a character class that lets raw
    control characters through (invalid JSON: the tiny-model test produced a raw 0x15 inside a string) and
    compiles them slowly (0.73 s for ``maxLength: 80`` on SmolLM2, 8 ms as a pattern). Like xgrammar's own
    rule, the pattern has no escape sequences; it counts characters, as ``maxLength`` does, and excludes
    surrogates, so the count holds in the decoded text too.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        if isinstance(low, int) and (high is None or isinstance(high, int)):
            out["pattern"] = f"^{_STRING_CHAR}{{{low},{'' if high is None else high}}}$"
        else:  # not integers: leave it to xgrammar to report
            out["minLength"], out["maxLength"] = low, high
    return out


def grammar_key(spec: StructuredOutputsParams) -> GrammarKey:
    """(kind, canonical text): equal for specs that compile to the same grammar (a schema given as a dict
    or as JSON text, keys in any order)."""
    kind = spec.kind
    if kind == "json_object":
        return kind, ""
    value = spec.value
    if kind in ("regex", "grammar"):
        return kind, value
    if kind == "json" and isinstance(value, str):
        value = json.loads(value)  # valid: checked by StructuredOutputsParams
    return kind, json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer, with an LRU cache of the results.

    The xgrammar tokenizer info (~0.1 s for a 49k vocabulary) is built on the first compile, so engines
    that never see a constrained request never import xgrammar. ``num_compiles`` / ``num_hits`` count
    cache misses and hits.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Seq[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_spec_bytes: int = MAX_SPEC_BYTES,
        any_whitespace: bool = False,
        max_threads: int = 1,
    ) -> None:
        if cache_size < 1 or cache_bytes < 1 or max_spec_bytes < 1:
            raise ValueError("cache_size, cache_bytes and max_spec_bytes must be >= 1")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.max_spec_bytes = max_spec_bytes
        # Compact JSON by default: with any whitespace allowed, small models tend to loop on newlines and
        # spaces until max_tokens, leaving a truncated object.
        self.any_whitespace = any_whitespace
        self.max_threads = max_threads
        self.num_compiles = 0
        self.num_hits = 0
        self._cache: OrderedDict[GrammarKey, tuple[Any, int]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._plain_compiler: Any = None  # no cache, the schema as given: the fallback of _compile_schema
        self._decoded_vocab: list[bytes] | None = None
        self._info: Any = None

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _import_xgrammar()
                info = self._info = xgrammar_tokenizer_info(
                    self.tokenizer, self.vocab_size, self.stop_token_ids
                )
                # xgrammar's cache also keeps sub-grammars (strings, numbers) that later schemas reuse: with
                # it a new small schema compiles in ~0.6 ms instead of ~4.5 ms. Bounded like ours.
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.max_threads, cache_enabled=True, cache_limit_bytes=self.cache_bytes
                )
            return self._compiler

    def __len__(self) -> int:
        return len(self._cache)

    def decoded_vocab(self) -> list[bytes]:
        """Each token's bytes as the grammar sees them (blank for tokens it never allows)."""
        self._xgr_compiler()
        with self._lock:
            if self._decoded_vocab is None:
                self._decoded_vocab = [bytes(token) for token in self._info.decoded_vocab]
            return self._decoded_vocab

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache when it was compiled before); ValueError when it
        is too large or does not compile."""
        key = grammar_key(spec)
        if len(key[1].encode()) > self.max_spec_bytes:
            raise ValueError(
                f"structured_outputs.{spec.kind}: the {spec.kind} is {len(key[1].encode())} bytes as text, "
                f"more than the limit of {self.max_spec_bytes}"
            )
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return hit[0]
        compiled = self._compile(spec, self._xgr_compiler())
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self.num_compiles += 1
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self._cached_bytes += size
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes
            ):
                _, (_, evicted) = self._cache.popitem(last=False)
                self._cached_bytes -= evicted
        return compiled

    def _compile(self, spec: StructuredOutputsParams, compiler: Any) -> Any:
        kind, value = spec.kind, spec.value
        try:
            if kind == "json_object":  # any object: xgrammar's separators option does not reach nested values
                return compiler.compile_json_schema({"type": "object"}, any_whitespace=self.any_whitespace)
            if kind == "json":
                return self._compile_schema(json.loads(value) if isinstance(value, str) else value, compiler)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in value))
            if kind == "grammar":
                return compiler.compile_grammar(value)
            return compiler.compile_structural_tag(_structural_tag(value))
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            # xgrammar's own errors (invalid schema, regex syntax, EBNF parse errors) carry the reason.
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"structured_outputs.{kind}: invalid {_NOUNS[kind]}: {reason}") from None
        except Exception as exc:  # pydantic's ValidationError for a malformed structural tag, and the like
            raise ValueError(f"structured_outputs.{kind}: invalid {_NOUNS[kind]}: {exc}") from None

    def _compile_schema(self, schema: Any, compiler: Any) -> Any:
        """A JSON schema's grammar: our rewrite on the cached compiler, else the schema as given on a compiler
        without a cache. A schema xgrammar itself accepts is never refused for our sake: xgrammar 0.2.8 failed an
        internal check (``per_rule_fsm_hashes``) on some rewritten schemas with its cache on, a string of exactly
        160 characters among them (tests/unit/engine/guided/test_schema_fuzz.py finds such schemas)."""
        # compact JSON has no space after ',' and ':' either, as in vLLM's compact mode: our outputs were
        # 5.6% longer than vLLM's on the same 20 schemas (scripts/bench_structured.py, batch 64)
        options = {"any_whitespace": self.any_whitespace, "separators": None if self.any_whitespace else (",", ":")}
        try:
            return compiler.compile_json_schema(bounded_strings_as_patterns(schema), **options)
        except (RuntimeError, ValueError, TypeError, KeyError):
            with self._lock:
                if self._plain_compiler is None:
                    xgr = _import_xgrammar()
                    self._plain_compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
                plain = self._plain_compiler
            return plain.compile_json_schema(schema, **options)  # its error, if any, is the schema's


_NOUNS = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "EBNF grammar",
    "structural_tag": "structural tag",
}
