"""The server on 127.0.0.1 driven by the real ``openai`` client (sync and async), on a tiny random Llama.

The backend is our native engine when it is available, else the transformers baseline, so these tests run
against a real model either way. Greedy outputs of random weights are gibberish but deterministic.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from api.main import create_app
from app.serving.backends.base import Backend
from app.settings import Settings
from tests.support.server_helpers import ServerThread, build_tiny_llama, make_backend, native_available
from tests.support.strategies import chat_bodies, completion_bodies

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-key"
KIND = "native" if native_available() else "transformers"
MSGS = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")  # shared by test_server_* modules


@pytest.fixture(scope="module")
def backend(tiny_llama: Path) -> Backend:
    return make_backend(KIND, tiny_llama)


@pytest.fixture(scope="module")
def server(backend: Backend) -> Iterator[ServerThread]:
    app = create_app(Settings(api_keys=[KEY]), backend=backend)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def aclient(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def greedy_chat(client: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": "tiny-llama", "messages": MSGS, "temperature": 0, "max_tokens": 12}
    return client.chat.completions.create(**{**args, **kw})


def wait_idle(backend: Backend, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = backend.stats()
        if stats is not None and stats.num_running == 0 and stats.num_waiting == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the backend still holds requests: {stats}")
        time.sleep(0.02)


def test_models(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == "tiny-llama" and model.object == "model"


def test_chat_completion(client: openai.OpenAI) -> None:
    resp = greedy_chat(client, extra_body={"ignore_eos": True})
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == "tiny-llama"
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12 and resp.usage.prompt_tokens > 4


async def test_completion_async(aclient: openai.AsyncOpenAI) -> None:
    resp = await aclient.completions.create(
        model="tiny-llama",
        prompt=["the lazy dog", "hello"],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 10


def test_streaming_with_usage_matches_non_streaming(client: openai.OpenAI) -> None:
    full = greedy_chat(client).choices[0].message.content
    stream = greedy_chat(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    no_usage = list(greedy_chat(client, stream=True))
    assert all(c.usage is None for c in no_usage)


async def test_async_streaming_completion(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.completions.create(
        model="tiny-llama", prompt="the lazy dog", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = await aclient.completions.create(
        model="tiny-llama",
        prompt="the lazy dog",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text == full.choices[0].text


def test_n2(client: openai.OpenAI) -> None:
    resp = greedy_chat(client, n=2, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage is not None and resp.usage.completion_tokens == 24


def test_stop(client: openai.OpenAI) -> None:
    full = greedy_chat(client, max_tokens=20, extra_body={"ignore_eos": True}).choices[0].message.content
    assert full and len(full) > 6
    stop = full[4:6]
    cut = full[: full.index(stop)]
    resp = greedy_chat(client, max_tokens=20, stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == cut
    assert resp.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        resp = greedy_chat(client, temperature=1.0, seed=seed, max_tokens=16, extra_body={"ignore_eos": True})
        return resp.choices[0].message.content

    first, again, other = sample(1234), sample(1234), sample(99)
    assert first == again
    assert first != other


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = greedy_chat(client, logprobs=True, top_logprobs=3, max_tokens=5, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the best token


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="tiny-llama",
        prompt="the lazy dog",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0


def test_error_classes(server: ServerThread, client: openai.OpenAI) -> None:
    bad_key = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.BadRequestError) as bad:
        greedy_chat(client, top_p=5)
    assert bad.value.body["param"] == "top_p"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        greedy_chat(client, max_tokens=100_000)
    assert long.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        greedy_chat(client, model="no-such-model")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.skipif(KIND != "native", reason="priority scheduling is the native engine's")
def test_priority_needs_priority_scheduling(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        greedy_chat(client, extra_body={"priority": 3})
    assert bad.value.body["param"] == "priority"  # type: ignore[index]
    assert greedy_chat(client, extra_body={"priority": 0}).choices


def test_rate_limit_error(tiny_llama: Path) -> None:
    options = {"max_num_seqs": 1, "scheduling_policy": "priority"} if KIND == "native" else {}
    backend = make_backend(KIND, tiny_llama, max_waiting=1, **options)
    with ServerThread(create_app(Settings(), backend=backend)) as srv:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        args: dict[str, Any] = {"model": "tiny-llama", "temperature": 0}

        async def run() -> list[Any]:
            long = {**args, "max_tokens": 200, "extra_body": {"ignore_eos": True}}
            results = await asyncio.gather(
                *(client.completions.create(prompt="the fox", **long) for _ in range(6)),
                return_exceptions=True,
            )
            if KIND == "native":  # with priority scheduling, a priority is accepted (lower runs first)
                urgent = await client.completions.create(
                    prompt="x", max_tokens=2, extra_body={"priority": -5}, **args
                )
                assert urgent.choices[0].finish_reason in ("stop", "length")
            return results

        results = asyncio.run(run())
        assert any(isinstance(r, openai.RateLimitError) for r in results), results
        assert any(not isinstance(r, Exception) for r in results), results


async def test_32_concurrent_streams_equal_sequential(aclient: openai.AsyncOpenAI) -> None:
    prompts = [f"the quick brown fox {'jumps ' * (i % 5)}over dog {i}" for i in range(32)]
    args: dict[str, Any] = {
        "model": "tiny-llama",
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    async def streamed(prompt: str) -> str:
        stream = await aclient.completions.create(prompt=prompt, stream=True, **args)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    concurrent = await asyncio.gather(*(streamed(p) for p in prompts))
    sequential = [(await aclient.completions.create(prompt=p, **args)).choices[0].text for p in prompts]
    assert concurrent == sequential
    assert all(concurrent)


def test_disconnect_frees_the_sequence(server: ServerThread, backend: Backend) -> None:
    body = {"prompt": "the fox", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    wait_idle(backend)
    started = time.monotonic()
    url = f"{server.base_url}/completions"
    with (  # streaming: read one event, then hang up
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json={**body, "stream": True}, headers=headers) as r,
    ):
        assert r.status_code == 200
        next(r.iter_lines())
    wait_idle(backend)
    with (
        httpx.Client(timeout=httpx.Timeout(10.0, read=0.03)) as http,
        pytest.raises(httpx.TimeoutException),
    ):  # send the request, then give up before the answer (500 tokens take the fast kernels ~0.2 s)
        http.post(url, json=body, headers=headers)
    wait_idle(backend)
    assert time.monotonic() - started < 8
    stats = backend.stats()
    assert stats is not None and stats.num_running == 0 and stats.num_waiting == 0
    if KIND == "native":
        assert stats.kv_cache_usage_perc == 0.0


def test_health_and_metrics(server: ServerThread) -> None:
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.root}/metrics").text
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny-llama"}' in text
    assert "vllm:num_requests_running" in text and "vllm:time_to_first_token_seconds_bucket" in text


@pytest.mark.skipif(KIND != "native", reason="the engine loop is the native backend's")
def test_health_is_503_when_the_engine_loop_is_dead_or_stalled(server: ServerThread, backend: Backend) -> None:
    engine: Any = backend.engine  # type: ignore[attr-defined]
    engine.errored = RuntimeError("boom")
    try:
        r = httpx.get(f"{server.root}/health")
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
    finally:
        engine.errored = None
    assert httpx.get(f"{server.root}/health").status_code == 200
    # Work waiting and no step within the stall limit: simulated with a pending stream and a limit below zero
    # (any heartbeat is then too old), so the live loop's own heartbeats cannot race the check.
    engine._streams["stuck"] = object()
    busy_since, engine.busy_since = engine.busy_since, time.time()  # as add_request marks the work's arrival
    limit = backend.health_stall_seconds  # type: ignore[attr-defined]
    backend.health_stall_seconds = -1.0  # type: ignore[attr-defined]
    try:
        r = httpx.get(f"{server.root}/health")
        assert r.status_code == 503 and "no step" in r.json()["error"]["message"]
    finally:
        del engine._streams["stuck"]
        engine.busy_since = busy_since
        backend.health_stall_seconds = limit  # type: ignore[attr-defined]
    assert httpx.get(f"{server.root}/health").status_code == 200


def test_tokenize_round_trip(server: ServerThread) -> None:
    tokens = httpx.post(
        f"{server.root}/tokenize", json={"prompt": "the lazy dog", "add_special_tokens": False}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.root}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "the lazy dog"}


FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def fuzz_check(server: ServerThread, path: str, body: Any) -> None:
    import json

    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    if "max_completion_tokens" not in body:
        body.setdefault(
            "max_tokens", 4
        )  # chat's default runs to the context length: too slow for a fuzz loop
    r = httpx.post(f"{server.base_url}{path}", content=json.dumps(body), headers=headers, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_on_the_real_model(server: ServerThread, body: dict[str, Any]) -> None:
    fuzz_check(server, "/chat/completions", body)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions_on_the_real_model(server: ServerThread, body: dict[str, Any]) -> None:
    fuzz_check(server, "/completions", body)
