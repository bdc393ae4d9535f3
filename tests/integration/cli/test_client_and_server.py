"""OpenAICompatibleClient against the real fake server on 127.0.0.1: parsing, error mapping, fake-server features."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

import aiohttp
import pytest
from pydantic import BaseModel

from app.pipeline.resources import (
    ConfigurationError,
    EndpointConfig,
    LLMRequest,
    LLMResponse,
    OpenAICompatibleClient,
    RateLimitError,
    ResourceError,
    TransientError,
    create_client,
    register_client_factory,
)
from app.pipeline.resources.client import parse_retry_after
from app.testing import FakeLLMServer, start_fake_server_process, stop_fake_server_process

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
async def server() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as srv:
        yield srv


def client_for(srv: FakeLLMServer, **kw: Any) -> OpenAICompatibleClient:
    return OpenAICompatibleClient(EndpointConfig("vllm", "test-model", base_url=srv.base_url, **kw))


async def test_completion_content_usage_and_timing(server: FakeLLMServer) -> None:
    async with client_for(server) as client:
        resp = await client.complete(LLMRequest("hello brave new world", system_prompt="be terse"))
    assert isinstance(resp, LLMResponse)
    assert resp.content == "echo: hello brave new world"
    assert resp.input_tokens == 6  # "be terse" + four words
    assert resp.output_tokens == 5
    assert resp.finish_reason == "stop"
    assert resp.model == "test-model"
    assert resp.completion_time_ms is not None and resp.completion_time_ms > 0
    assert server.stats()["prompts"] == {"hello brave new world": 1}


async def test_session_is_pooled_and_reused(server: FakeLLMServer) -> None:
    async with client_for(server) as client:
        await client.complete(LLMRequest("one"))
        first = client._session
        await asyncio.gather(*(client.complete(LLMRequest(f"r{i}")) for i in range(20)))
        assert client._session is first


def test_client_survives_a_change_of_event_loop() -> None:
    with FakeLLMServer() as srv:
        client = client_for(srv)
        for _ in range(2):  # two asyncio.run calls: the second gets a fresh pool on its own loop
            resp = asyncio.run(client.complete(LLMRequest("again")))
            assert resp.content == "echo: again"
        asyncio.run(client.aclose())


def test_payload_merges_every_option() -> None:
    class Answer(BaseModel):
        text: str
        score: int

    client = OpenAICompatibleClient(EndpointConfig("openai", "gpt-x", api_key="sk-test"))
    assert client.base_url == "https://api.openai.com/v1"
    assert client._headers["Authorization"] == "Bearer sk-test"
    req = LLMRequest(
        [{"role": "user", "content": "hi"}],
        temperature=0.2,
        max_tokens=7,
        stop=["\n"],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="auto",
        response_format=Answer,
        extra_body={"top_p": 0.5, "temperature": 0.9},
    )
    body = client.build_payload(req)
    assert body["model"] == "gpt-x" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 7 and body["stop"] == ["\n"] and body["tool_choice"] == "auto"
    assert body["temperature"] == 0.9 and body["top_p"] == 0.5  # extra_body wins
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Answer"
    assert set(fmt["json_schema"]["schema"]["properties"]) == {"text", "score"}
    raw = {"type": "json_object"}
    assert client.build_payload(LLMRequest("x", response_format=raw))["response_format"] is raw


async def test_structured_output_round_trip(server: FakeLLMServer) -> None:
    class Answer(BaseModel):
        text: str
        score: int

    async with client_for(server) as client:
        resp = await client.complete(LLMRequest("rate this", response_format=Answer))
    assert Answer.model_validate_json(resp.content) == Answer(text="rate this", score=0)


async def test_429_becomes_rate_limit_error_with_retry_after(server: FakeLLMServer) -> None:
    async with client_for(server) as client:
        with pytest.raises(RateLimitError) as info:
            await client.complete(LLMRequest("slow down [[status:429]]"))
        assert info.value.status == 429 and info.value.retry_after == pytest.approx(1.0)
        server.configure(fail_next=1, fail_status=429, retry_after=2.5)
        with pytest.raises(RateLimitError) as info:
            await client.complete(LLMRequest("again"))
        assert info.value.retry_after == pytest.approx(2.5)
        assert "scripted failure" in str(info.value)


def test_retry_after_header_forms() -> None:
    assert parse_retry_after({"Retry-After": "3"}) == 3.0
    assert parse_retry_after({"Retry-After": "0.25"}) == 0.25
    assert parse_retry_after({"retry-after-ms": "1500", "Retry-After": "2"}) == 1.5
    assert parse_retry_after({}) is None
    assert parse_retry_after({"Retry-After": "soon"}) is None
    future = formatdate(time.time() + 30, usegmt=True)
    assert parse_retry_after({"Retry-After": future}) == pytest.approx(30, abs=2)
    assert parse_retry_after({"Retry-After": formatdate(time.time() - 30, usegmt=True)}) == 0.0


async def test_5xx_is_transient(server: FakeLLMServer) -> None:
    async with client_for(server) as client:
        with pytest.raises(TransientError) as info:
            await client.complete(LLMRequest("boom [[status:500]]"))
        assert info.value.status == 500
        server.configure(fail_next=2, fail_status=503)
        for _ in range(2):
            with pytest.raises(TransientError, match="503"):
                await client.complete(LLMRequest("x"))
        assert (await client.complete(LLMRequest("x"))).content == "echo: x"
    assert server.stats()["by_status"] == {"500": 1, "503": 2, "200": 1}


async def test_hang_times_out_as_transient(server: FakeLLMServer) -> None:
    async with client_for(server, timeout=0.3) as client:
        started = time.perf_counter()
        with pytest.raises(TransientError, match=r"timed out after 0\.3s"):
            await client.complete(LLMRequest("wait [[hang]]"))
        assert time.perf_counter() - started < 2.0
        server.configure(hang=True, hang_seconds=1.0)
        with pytest.raises(TransientError):
            await client.complete(LLMRequest("wait"))


async def test_4xx_is_a_plain_resource_error_with_the_server_message(server: FakeLLMServer) -> None:
    async with client_for(server) as client:
        with pytest.raises(ResourceError) as info:
            await client.complete(LLMRequest("bad [[status:400]]"))
    assert not isinstance(info.value, TransientError | RateLimitError)
    assert info.value.status == 400
    assert "marker asked for status 400" in str(info.value)


async def test_connection_refused_is_transient() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    cfg = EndpointConfig("vllm", "m", base_url=f"http://127.0.0.1:{port}/v1")
    async with OpenAICompatibleClient(cfg, alias="local") as client:
        with pytest.raises(TransientError, match="cannot connect") as info:
            await client.complete(LLMRequest("x"))
    assert info.value.alias == "local"


def test_missing_base_url_and_client_registry() -> None:
    with pytest.raises(ConfigurationError, match="needs a base_url"):
        OpenAICompatibleClient(EndpointConfig("vllm", "m"))
    # another test in the same process may have registered the embedded engine: take it out for this check
    registered = register_client_factory("native", None)
    try:
        with pytest.raises(ConfigurationError, match="register_embedded_engine"):
            create_client(EndpointConfig("native", "smollm"))
    finally:
        register_client_factory("native", registered)

    class InProcess:
        def __init__(self, config: EndpointConfig) -> None:
            self.config = config

        async def complete(self, request: LLMRequest) -> LLMResponse:
            return LLMResponse(content="local")

        async def aclose(self) -> None:
            pass

    previous = register_client_factory("native", InProcess)
    try:
        assert isinstance(create_client(EndpointConfig("native", "smollm")), InProcess)
        # With a base_url a native endpoint is reached over HTTP.
        over_http = create_client(EndpointConfig("native", "smollm", base_url="http://127.0.0.1:1/v1"))
        assert isinstance(over_http, OpenAICompatibleClient)
    finally:
        register_client_factory("native", previous)


async def test_fake_server_other_routes_and_control_api(server: FakeLLMServer) -> None:
    root = server.url
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.base_url}/models") as r:
            assert (await r.json())["data"][0]["id"] == "fake-model"
        async with http.post(f"{server.base_url}/completions", json={"model": "m", "prompt": ["a b", "c"]}) as r:
            body = await r.json()
            assert [c["text"] for c in body["choices"]] == ["echo: a b", "echo: c"]
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        async with http.post(f"{root}/_control", json={"reply": "[{model}] {prompt}!"}) as r:
            assert r.status == 200
        async with http.post(f"{root}/_control", json={"nonsense": 1}) as r:
            assert r.status == 400 and "unknown fake-server settings" in (await r.json())["error"]["message"]
        async with http.post(f"{root}/_control", json={"latency": "soon"}) as r:
            assert r.status == 400 and "not a valid float" in (await r.json())["error"]["message"]
        async with http.post(f"{server.base_url}/chat/completions", data=b"{not json") as r:
            assert r.status == 400
        msgs = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(f"{server.base_url}/chat/completions", json=msgs) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == "[m] hi!"
        stream = {**msgs, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(f"{server.base_url}/chat/completions", json=stream) as r:
            events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "[m] hi!"
        assert chunks[-1]["usage"]["completion_tokens"] == 2
        async with http.get(f"{root}/_stats") as r:
            stats = await r.json()
        assert stats["total"] == 4 and stats["by_status"] == {"200": 3, "400": 1}
        assert stats["prompts"] == {"c": 1, "hi": 2}  # the last prompt of /v1/completions, the chat twice
        async with http.post(f"{root}/_reset") as r:
            assert r.status == 200
    assert server.stats()["total"] == 0


async def test_fake_server_tracks_in_flight_and_latency_markers(server: FakeLLMServer) -> None:
    server.configure(latency=0.1)
    async with client_for(server) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client.complete(LLMRequest(f"p{i}")) for i in range(8)))
        assert time.perf_counter() - started < 0.5  # concurrent, not serialised
        fast = time.perf_counter()
        await client.complete(LLMRequest("quick [[latency:0]]"))
        assert time.perf_counter() - fast < 0.08
    stats = server.stats()
    assert stats["max_in_flight"] == 8 and stats["in_flight"] == 0
    assert len(stats["timestamps"]) == 9


async def test_reset_keeps_counting_requests_in_flight(server: FakeLLMServer) -> None:
    server.configure(latency=0.2)
    async with client_for(server) as client:
        pending = asyncio.gather(*(client.complete(LLMRequest(f"p{i}")) for i in range(3)))
        await asyncio.sleep(0.1)
        server.reset()
        assert server.stats()["in_flight"] == 3 and server.stats()["total"] == 0
        await pending
    stats = server.stats()
    assert stats["in_flight"] == 0 and stats["by_status"] == {"200": 3}
    server.reset(behaviour=True)
    assert server.behaviour.latency == 0.0


async def test_fake_server_rpm_limit_returns_429_with_retry_after() -> None:
    async with FakeLLMServer(rpm=60) as srv, client_for(srv) as client:
        await client.complete(LLMRequest("first"))
        with pytest.raises(RateLimitError) as info:
            await client.complete(LLMRequest("second"))
        assert 0.5 < (info.value.retry_after or 0) <= 1.0


def test_subprocess_mode_serves_requests() -> None:
    proc, base_url = start_fake_server_process(latency=0.0, rpm=600000)
    try:
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        client = OpenAICompatibleClient(EndpointConfig("vllm", "m", base_url=base_url))

        async def go() -> str:
            try:
                return (await client.complete(LLMRequest("from a process"))).content
            finally:
                await client.aclose()

        assert asyncio.run(go()) == "echo: from a process"
    finally:
        stop_fake_server_process(proc)
    assert proc.returncode is not None
