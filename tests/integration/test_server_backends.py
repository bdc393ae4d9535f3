"""The same server in front of the other backends: transformers (baseline), openai (proxy), vllm (managed).

The vllm test runs only when ``INF_ENGINE_VLLM_PYTHON`` names a Python that has vLLM; it serves the default
SmolLM2 (vLLM's CPU kernels do not take the tiny test model's head size).
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

from api.main import create_app
from app.engine.core.sampling_params import SamplingParams
from app.serving.backends.base import Backend, BackendError, GenerationRequest, QueueFullError
from app.serving.backends.openai_proxy import OpenAIProxyBackend
from app.settings import Settings
from app.testing import FakeLLMServer
from tests.support.server_helpers import ServerThread, build_tiny_llama, make_backend, native_available

pytestmark = pytest.mark.timeout(120)
MSGS = [{"role": "user", "content": "the quick brown fox"}]
GREEDY: dict[str, Any] = {
    "model": "tiny-llama",
    "temperature": 0,
    "max_tokens": 8,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


def serve(backend: Backend, timeout: float = 120.0, **settings: Any) -> ServerThread:
    return ServerThread(create_app(Settings(**settings), backend=backend)).start(timeout)


@pytest.fixture(scope="module")
def hf_server(tiny_llama: Path) -> Iterator[tuple[ServerThread, Backend]]:
    backend = make_backend("transformers", tiny_llama)
    srv = serve(backend)
    yield srv, backend
    srv.stop()


def client_of(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------------ transformers
def test_transformers_chat_stream_stop_seed_logprobs(hf_server: tuple[ServerThread, Backend]) -> None:
    client = client_of(hf_server[0])
    full = (
        client.chat.completions.create(messages=MSGS, **{**GREEDY, "max_tokens": 10})
        .choices[0]
        .message.content
    )
    assert full and len(full) > 6
    chunks = list(client.chat.completions.create(messages=MSGS, stream=True, stream_options={"include_usage": True},
                                                 **{**GREEDY, "max_tokens": 10}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    stop = full[4:6]
    cut = client.chat.completions.create(messages=MSGS, stop=[stop], **{**GREEDY, "max_tokens": 10}).choices[
        0
    ]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    sampled = [
        client.chat.completions.create(messages=MSGS, **{**GREEDY, "temperature": 1.0, "seed": s})
        .choices[0]
        .message.content
        for s in (5, 5, 6)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    lp = (
        client.chat.completions.create(messages=MSGS, logprobs=True, top_logprobs=2, **GREEDY)
        .choices[0]
        .logprobs
    )
    assert lp is not None and lp.content is not None and len(lp.content) == 8
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4) for e in lp.content)
    resp = client.completions.create(prompt="the lazy dog", n=2, **{**GREEDY, "temperature": 1.0, "seed": 3})
    assert (
        [c.index for c in resp.choices] == [0, 1]
        and resp.usage is not None
        and resp.usage.completion_tokens == 16
    )


def test_transformers_disconnect_stops_generation(hf_server: tuple[ServerThread, Backend]) -> None:
    srv, backend = hf_server
    body = {"prompt": "the fox", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{srv.base_url}/completions", json=body) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 5
    while (s := backend.stats()) is not None and (s.num_running or s.num_waiting):
        assert time.monotonic() < deadline, "the aborted request kept running"
        time.sleep(0.02)


def test_transformers_queue_full_is_429(tiny_llama: Path) -> None:
    backend = make_backend("transformers", tiny_llama, max_waiting=1)
    srv = serve(backend)
    try:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="x", max_retries=0)

        async def run() -> list[Any]:
            return await asyncio.gather(
                *(client.completions.create(prompt="fox", **{**GREEDY, "max_tokens": 100}) for _ in range(4)),
                return_exceptions=True,
            )

        results = asyncio.run(run())
        assert any(isinstance(r, openai.RateLimitError) for r in results), results
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------ openai proxy
@pytest.fixture(scope="module")
def upstream(tiny_llama: Path) -> Iterator[ServerThread]:
    kind = "native" if native_available() else "transformers"
    srv = serve(make_backend(kind, tiny_llama), api_keys=["upstream-key"])
    yield srv
    srv.stop()


def test_openai_proxy_passes_everything_through(upstream: ServerThread) -> None:
    proxy_backend = OpenAIProxyBackend(
        base_url=upstream.base_url, api_key="upstream-key", served_model_name="proxied"
    )
    srv = serve(proxy_backend, api_keys=["front-key"])
    try:
        front = openai.OpenAI(base_url=srv.base_url, api_key="front-key", max_retries=0)
        direct = openai.OpenAI(base_url=upstream.base_url, api_key="upstream-key", max_retries=0)
        assert [m.id for m in front.models.list().data] == ["proxied"]
        args = {**GREEDY, "max_tokens": 10}
        want = direct.chat.completions.create(messages=MSGS, **args)
        got = front.chat.completions.create(messages=MSGS, **{**args, "model": "proxied"})
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage == want.usage and got.model == "proxied"
        chunks = list(front.completions.create(prompt="the lazy dog", stream=True, logprobs=2,
                                               stream_options={"include_usage": True}, **{**args, "model": "proxied"}))  # fmt: skip
        plain = direct.completions.create(prompt="the lazy dog", logprobs=2, **args)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
        assert chunks[-1].usage == plain.usage
        tokens = [t for c in chunks if c.choices for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
        assert tokens == plain.choices[0].logprobs.tokens  # type: ignore[union-attr]
        n2 = front.completions.create(prompt=["a b", "c d"], n=2, **{**args, "model": "proxied"})
        assert [c.index for c in n2.choices] == [0, 1, 2, 3]
        with pytest.raises(openai.BadRequestError) as bad:  # the upstream's 400 comes back as a 400
            front.completions.create(prompt=[10**6], **{**args, "model": "proxied"})
        assert bad.value.status_code == 400
        tok = httpx.post(f"{srv.root}/tokenize", json={"prompt": "the lazy dog"}).json()
        assert (
            tok["tokens"]
            == httpx.post(f"{upstream.root}/tokenize", json={"prompt": "the lazy dog"}).json()["tokens"]
        )
        assert httpx.get(f"{srv.root}/health").status_code == 200
    finally:
        srv.stop()


async def test_openai_proxy_maps_upstream_errors() -> None:
    async with FakeLLMServer() as fake:
        backend = OpenAIProxyBackend(base_url=fake.base_url, api_key="k")
        await backend.start()
        try:
            assert backend.served_model_name == "fake-model" and (await backend.health()).ok

            async def run(content: str) -> str:
                req = GenerationRequest(
                    "r", SamplingParams(max_tokens=5), messages=[{"role": "user", "content": content}]
                )
                stream = await backend.generate(req)
                return "".join([d.text async for c in stream for d in c.deltas])

            assert await run("hello") == "echo: hello"
            with pytest.raises(QueueFullError):
                await run("[[status:429]] busy")
            with pytest.raises(BackendError) as err:
                await run("[[status:500]] broken")
            assert err.value.status == 502
        finally:
            await backend.stop()
    dead = OpenAIProxyBackend(base_url="http://127.0.0.1:9/v1", upstream_model="m")
    await dead.start()
    try:
        assert not (await dead.health()).ok
        with pytest.raises(BackendError) as unreachable:
            await dead.generate(GenerationRequest("r", SamplingParams(), prompt="x"))
        assert unreachable.value.status == 503
    finally:
        await dead.stop()


# ------------------------------------------------------------------------------------------ vllm
@pytest.mark.timeout(1500)  # vLLM-CPU compiles its model on a first start
def test_vllm_managed_subprocess() -> None:
    settings = Settings()
    if settings.vllm_python is None:
        pytest.skip("set INF_ENGINE_VLLM_PYTHON to a Python with vLLM to run the vllm backend test")
    from app.serving.backends.vllm import VLLMBackend

    backend = VLLMBackend(
        python=settings.vllm_python,
        extra_args=["--dtype", "float32", "--max-model-len", "2048", *settings.vllm_extra_args],
        startup_timeout=settings.vllm_startup_timeout,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},  # vLLM-CPU otherwise wants 92% of the machine's memory
    )
    srv = serve(backend, timeout=settings.vllm_startup_timeout + 60)
    try:
        process = backend.process
        assert process is not None and process.returncode is None
        client = client_of(srv)
        args = {"model": backend.served_model_name, "temperature": 0, "max_tokens": 12}
        resp = client.chat.completions.create(
            messages=[{"role": "user", "content": "What is the capital of France?"}], **args
        )
        assert "Paris" in (resp.choices[0].message.content or "")
        chunks = list(
            client.completions.create(
                prompt="1, 2, 3,", stream=True, stream_options={"include_usage": True}, **args
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        assert httpx.get(f"{srv.root}/health").status_code == 200
    finally:
        srv.stop()
    assert backend.process is None and process.returncode is not None  # stopped with the server


# ------------------------------------------------------------------------------------------ the real model
@pytest.mark.slow
@pytest.mark.skipif(not native_available(), reason="the native engine is not built yet")
def test_native_smollm2_answers_like_a_chat_model() -> None:
    from app.engine.loading import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    backend = make_backend("native", None)
    srv = serve(backend)
    try:
        client = client_of(srv)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=16,
        )
        assert "Paris" in (resp.choices[0].message.content or "")
    finally:
        srv.stop()
