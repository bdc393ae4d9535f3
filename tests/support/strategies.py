"""Hypothesis strategies for OpenAI request bodies: a valid body with zero to two fields made wild.

Valid values keep n and max_tokens small so that each accepted call is quick on a real model; wild values
are out-of-range numbers, wrong types, or arbitrary JSON.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

junk: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)

text = st.text(max_size=24)
ids = st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=6)
wild_ids = st.lists(st.integers(min_value=-5, max_value=10**6), max_size=6)
unit = st.floats(min_value=0.01, max_value=1.0)

# name -> (valid values, wild values)
SAMPLING: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "model": (st.none(), st.sampled_from(["nope", ""]) | junk),
    "max_tokens": (st.integers(1, 6), st.integers(-3, 0) | st.just(10**9) | st.just(2**40) | junk),
    "temperature": (st.floats(0, 2), st.floats(-5, -0.01) | st.floats(allow_nan=True) | junk),
    "top_p": (unit, st.floats(-1, 0) | st.floats(1.01, 9) | junk),
    "top_k": (st.integers(-1, 50), st.integers(-(10**6), -2) | st.integers(10**5, 10**12) | junk),
    "min_p": (st.floats(0, 1), st.floats(1.01, 5) | st.floats(-5, -0.01) | junk),
    "n": (st.integers(1, 2), st.integers(-3, 0) | st.integers(129, 10**9) | junk),
    "stop": (
        st.none() | text.filter(bool) | st.lists(text.filter(bool), max_size=3),
        st.lists(text, max_size=3) | junk,
    ),
    "stop_token_ids": (st.lists(st.integers(0, 300), max_size=3), wild_ids | junk),
    "seed": (st.integers(0, 2**32), st.integers(2**64, 2**70) | st.integers(-(2**70), -(2**63) - 1) | junk),
    "presence_penalty": (st.floats(-2, 2), st.floats(2.01, 100) | junk),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-100, -2.01) | junk),
    "repetition_penalty": (st.floats(0.5, 2), st.floats(-3, 0) | junk),
    "logit_bias": (
        st.dictionaries(st.sampled_from(["0", "5", "100", "300"]), st.floats(-100, 100), max_size=3),
        st.dictionaries(
            st.sampled_from(["319", "320", "-1", "x", "99999", "1e3"]), st.floats(-150, 150), max_size=3
        )
        | junk,
    ),
    "user": (text, junk),
    "priority": (st.integers(-5, 5), st.integers(2**40, 2**70) | junk),
    "ignore_eos": (st.booleans(), junk),
    "min_tokens": (st.integers(0, 1), st.integers(-5, -1) | st.integers(7, 10**6) | junk),
    "stream": (st.booleans(), junk),
    "stream_options": (st.none(), st.fixed_dictionaries({"include_usage": st.booleans()}) | junk),
    "skip_special_tokens": (st.booleans(), junk),
    "some_future_field": (junk, junk),
}

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text})
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text})
wild_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["", "tool", "x"]) | junk, "content": junk}
) | st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(part, max_size=2)})

CHAT: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    **SAMPLING,
    "messages": (
        st.lists(message, min_size=1, max_size=3),
        st.lists(message | wild_message, max_size=3) | junk,
    ),
    "max_completion_tokens": (st.integers(1, 6), st.integers(-3, 0) | st.just(10**9) | junk),
    "logprobs": (st.booleans(), junk),
    "top_logprobs": (st.integers(0, 5), st.integers(-3, -1) | st.integers(21, 10**6) | junk),
}
COMPLETION: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    **SAMPLING,
    "prompt": (
        text.filter(bool)
        | st.lists(text.filter(bool), min_size=1, max_size=2)
        | ids
        | st.lists(ids, min_size=1, max_size=2),
        st.just("") | st.just([]) | st.just([[]]) | wild_ids | st.lists(wild_ids, max_size=2) | junk,
    ),
    "logprobs": (st.integers(0, 5) | st.none(), st.integers(-3, -1) | st.integers(21, 10**6) | junk),
    "echo": (st.booleans(), junk),
    "suffix": (text, junk),
}

REQUIRED = {"messages", "prompt"}


@st.composite
def _body(
    draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]
) -> dict[str, Any]:
    names = sorted(fields)
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=8))
    body = {name: draw(fields[name][0]) for name in names if name in REQUIRED or name in chosen}
    if body.get("stream_options") is not None or not body.get("stream"):
        body.pop("stream_options", None)
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=2)):
        body[name] = draw(fields[name][1])
    if draw(st.sampled_from([False] * 15 + [True])):  # now and then, a required field goes missing
        for name in REQUIRED:
            body.pop(name, None)
    return body


chat_bodies = _body(CHAT)
completion_bodies = _body(COMPLETION)
any_body = st.one_of(chat_bodies, completion_bodies, junk)
