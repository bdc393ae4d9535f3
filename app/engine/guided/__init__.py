"""Guided decoding (structured outputs): the output of a request follows a JSON schema, any JSON object, a
regular expression, a choice among strings, an EBNF grammar or a structural tag
(``SamplingParams.structured_outputs``, a :class:`~app.engine.core.sampling_params.StructuredOutputsParams`).

* :mod:`.backend`: compiling a spec into a grammar over the engine's vocabulary, behind a bounded LRU cache;
  an invalid or too large spec is a ValueError when the request is added.
* :mod:`.matcher`: a matcher per sequence (``n`` and ``best_of`` siblings each have one), synced to the
  sequence's output tokens (rolled back or rebuilt after anything that changed them), filling the step's
  bitmask rows and advanced with the tokens the scheduler appended; the engine's :class:`GuidedDecoding`.
* :mod:`.closing`: ending a constrained output validly before its token budget runs out.
* :mod:`.bitmask`: the allowed-token bitmask, applied inside the batched sampler in one pass over the
  constrained rows only.

How a constrained sequence ends: its grammar allows the model's eos only once the grammar is complete, the
matcher terminates on it and the sequence finishes with finish_reason "stop" (also with ``ignore_eos``).
Near the end of the budget (``max_tokens`` or the context length) :mod:`.closing` steers the output to the
grammar's shortest end, so it is still complete and valid, with finish_reason "length"; only a budget shorter
than the shortest valid output gives a truncated one. Stop strings still apply (and may
cut the output short of the grammar's end). ``min_tokens`` does not hold eos back on constrained rows: the
grammar alone decides when the output may end. Speculative decoding skips constrained sequences (see
:mod:`app.engine.spec_decode` for why); prefix caching is unaffected (the grammar never touches the KV).

The library: xgrammar, chosen over llguidance by ``scripts/bench_grammar_libs.py`` on SmolLM2's tokenizer
(49,152 tokens; ten JSON schemas with valid instances of 30-101 tokens; each library in a fresh process,
medians of three runs, one thread):

                                          xgrammar 0.2.8   llguidance 1.9.1
    tokenizer-info setup (s)                       0.091              0.194
    compile, first, median schema (ms)              0.78               0.58
    compile, first, slowest schema (ms)           734.93               0.80
    compile, cached (ms)                           0.022              0.001
    mask fill per token (us)                         4.2               13.0
    advance per token (us)                           1.0                1.9
    fill + advance per token (us)                    5.2               14.9

The per-token cost is paid at every step for every constrained row, on the step's critical path, and there
xgrammar is ~3x cheaper; its setup is 2x faster. llguidance compiles lazily, so its first compile is always
sub-millisecond, where xgrammar's is too for most schemas (it reuses sub-grammars it compiled before) but
took 0.73 s for one with a bounded-length string (``maxLength: 80``). That cost is paid once per distinct
schema (cached), on a worker thread (xgrammar drops the GIL; ``AsyncEngine`` compiles there before the
request joins the batch), so it delays only that request's first token. llguidance is not clearly better;
xgrammar also gives the GBNF dialect and structural tags the API exposes. The mask is applied by our own
torch byte-table pass, faster than both libraries' kernels (see :mod:`.bitmask`).
"""
