"""The HTTP API against a scripted backend: shapes, streaming, errors, auth, ids, logs, metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from app.serving.backends.base import HealthStatus
from app.settings import Settings
from tests.support.serving_fakes import FakeBackend

MSGS = [{"role": "user", "content": "hello there"}]


def make_client(backend: FakeBackend | None = None, **settings: Any) -> TestClient:
    app = create_app(Settings(**settings), backend=backend or FakeBackend())
    return TestClient(app)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with make_client(backend) as c:
        yield c


def sse(response: Any) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_lifespan_starts_and_stops_the_backend(backend: FakeBackend) -> None:
    with make_client(backend):
        assert backend.started and not backend.stopped
    assert backend.stopped


def test_models(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "fake-model" and card["object"] == "model" and card["max_model_len"] == 4096
    assert isinstance(card["created"], int) and card["owned_by"]


def test_chat_completion_shape(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": MSGS, "max_tokens": 100})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "echo: hello there"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    # prompt: "<user>hello there" = 17 chars; completion: 17 chars + eos
    assert body["usage"] == {"prompt_tokens": 17, "completion_tokens": 18, "total_tokens": 35}


def test_model_may_be_omitted_and_length_finish(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json={"messages": MSGS, "max_completion_tokens": 4}).json()
    assert body["choices"][0]["message"]["content"] == "echo"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


def test_stop_string_is_excluded(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json={"messages": MSGS, "stop": [" th"]}).json()
    assert body["choices"][0]["message"]["content"] == "echo: hello"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_completions_list_of_prompts_and_n(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": ["first one", "second"], "n": 2, "max_tokens": 50})
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    texts = [(c["index"], c["text"]) for c in body["choices"]]
    assert texts == [(0, "echo: first one"), (1, "echo: first one"), (2, "echo: second"), (3, "echo: second")]
    assert body["usage"]["prompt_tokens"] == len("first one") + len("second")
    assert body["usage"]["completion_tokens"] == 2 * (len("echo: first one") + 1) + 2 * (
        len("echo: second") + 1
    )


def test_completion_echo_and_token_prompt(client: TestClient) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": [ord(c) for c in "abc"], "echo": True, "max_tokens": 9}
    ).json()
    assert body["choices"][0]["text"] == "abc" + "echo: abc"
    assert body["usage"]["prompt_tokens"] == 3


def test_completion_logprobs_shape(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 3, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["e", "c", "h"] and lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {"e": -0.1, "f": -0.2}


def test_chat_logprobs_shape(client: TestClient) -> None:
    body = client.post(
        "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "e",
        "logprob": -0.5,
        "bytes": [101],
        "top_logprobs": [{"token": "e", "logprob": -0.1, "bytes": [101]}],
    }


def test_chat_streaming_shapes(client: TestClient) -> None:
    body = {"messages": MSGS, "max_tokens": 5, "n": 2, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)  # not asked for
    first = [c["choices"][0] for c in chunks[:2]]
    assert [f["index"] for f in first] == [0, 1]
    assert all(f["delta"] == {"role": "assistant", "content": ""} for f in first)
    for index in (0, 1):
        parts = [ch for c in chunks[2:] for ch in c["choices"] if ch["index"] == index]
        assert "".join(p["delta"].get("content", "") for p in parts) == "echo:"
        assert [p["finish_reason"] for p in parts if p["finish_reason"]] == ["length"]


def test_streaming_usage_only_when_asked(client: TestClient) -> None:
    body = {"prompt": "abc", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "echo"
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


def test_streaming_echo(client: TestClient) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "stream": True, "echo": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse(r)
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "abcec"


def test_unknown_model_is_404(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSGS})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MSGS, "top_p": 5}, "top_p"),
        ("/v1/chat/completions", {"messages": MSGS, "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {}, "prompt"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_with_param(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_invalid_json_is_400(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400


def test_queue_full_is_429() -> None:
    with make_client(FakeBackend(max_in_flight=0)) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "stream": True})
        assert r.status_code == 429  # a stream that cannot start is an HTTP error, not an SSE event


def test_api_keys_guard_v1_only() -> None:
    with make_client(api_keys=["k1", "k2"]) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.post("/tokenize", json={"prompt": "ab"}).status_code == 200


def test_health_reports_backend_state(client: TestClient, backend: FakeBackend) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    backend.healthy = HealthStatus(False, "the engine has work but made no step for 99.0s")
    r = client.get("/health")
    assert r.status_code == 503 and "no step" in r.json()["error"]["message"]


def test_request_id_round_trip_and_json_access_log(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="inf_engine.access"):
        r = client.get("/v1/models", headers={"X-Request-ID": "abc-123"})
        generated = client.get("/health").headers["x-request-id"]
    assert r.headers["x-request-id"] == "abc-123" and len(generated) == 32
    records = [rec for rec in caplog.records if rec.name == "inf_engine.access"]
    first = records[0].__dict__
    assert (first["request_id"], first["method"], first["path"], first["status"]) == (
        "abc-123",
        "GET",
        "/v1/models",
        200,
    )
    assert first["latency_ms"] >= 0
    from app.serving.logs import JsonFormatter

    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "abc-123" and line["status"] == 200 and line["path"] == "/v1/models"


def test_metrics_use_vllm_names_and_labels(client: TestClient) -> None:
    client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3})
    text = client.get("/metrics").text
    labels = '{engine="0",model_name="fake-model"}'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        assert f"{name}{labels}" in text, name
    assert f"vllm:generation_tokens_total{labels} 3.0" in text
    assert (
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 1.0' in text
    )
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="200"} 1.0' in text
    assert "_created" not in text


def test_tokenize_and_detokenize(client: TestClient) -> None:
    body = client.post("/tokenize", json={"prompt": "abc"}).json()
    assert body == {"count": 3, "max_model_len": 4096, "tokens": [97, 98, 99], "token_strs": None}
    chat = client.post("/tokenize", json={"messages": MSGS}).json()
    assert chat["count"] == len("<user>hello there")
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    r = client.post("/detokenize", json={"tokens": [0x110000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={}).status_code == 400


def test_unknown_route_is_an_openai_404(client: TestClient) -> None:
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_cors_from_settings() -> None:
    with make_client(cors_origins=["http://ui.example"]) as c:
        r = c.options(
            "/v1/models",
            headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "GET"},
        )
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.get("/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_closing_a_stream_aborts_the_request(backend: FakeBackend) -> None:
    backend.token_delay = 0.01
    with make_client(backend) as c:
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 50, "stream": True}
        ) as r:
            next(r.iter_lines())
        import time

        deadline = time.monotonic() + 5
        while backend.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not backend.active and backend.aborted


def test_a_failed_sibling_prompt_aborts_the_queued_ones() -> None:
    backend = FakeBackend(max_in_flight=1)
    with make_client(backend) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": ["first", "second"], "stream": stream})
            assert r.status_code == 429
        assert not backend.active and len(backend.aborted) == 2  # queued, never read, still aborted
