"""A real, fast, scriptable OpenAI-compatible server for tests, benchmarks and demos.

It answers ``/v1/chat/completions`` (plain and SSE), ``/v1/completions``, ``/v1/embeddings`` (made-up
vectors: :func:`fake_embedding`) and ``/v1/models`` with OpenAI-shaped
bodies; the default reply is ``"echo: <last user message>"`` and token counts are whitespace word counts.

Behaviour (see :class:`FakeBehaviour`) is set at start, changed at run time with ``POST /_control`` (JSON) or
``configure(**kw)``, and stats are read with ``GET /_stats`` or ``stats()``; ``POST /_reset`` clears them.
A prompt may also carry markers: ``[[status:500]]``, ``[[status:429]]``, ``[[hang]]``, ``[[latency:0.2]]``.

Two ways to run it:

* in process: ``with FakeLLMServer(latency=0.05) as srv: ... srv.base_url`` (a background thread with its own loop);
* as a process, for load: ``python -m app.testing.fake_llm_server --port 0 --latency 0.05`` prints
  ``READY http://127.0.0.1:PORT/v1`` once it listens; :func:`start_fake_server_process` wraps that.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

_MARKER = re.compile(r"\[\[(status:\d{3}|latency:\d+(?:\.\d*)?|hang)\]\]")
_JSON = "application/json"


@dataclass
class FakeBehaviour:
    """How the fake server behaves; every field can be changed at run time."""

    latency: float = 0.0  # seconds before each answer
    jitter: float = 0.0  # plus uniform(0, jitter) seconds
    rpm: float | None = None  # server-side limit: beyond it, 429 with Retry-After
    rpm_burst: float = 1.0  # requests the server's bucket may hold when idle
    fail_next: int = 0  # fail the next N requests with fail_status
    fail_status: int = 500
    retry_after: float | None = 1.0  # Retry-After seconds on scripted 429s (None: no header)
    hang: bool = False  # never answer (or answer after hang_seconds)
    hang_seconds: float | None = None
    reply: str = "echo: {prompt}"  # template; {prompt} and {model} are replaced
    model: str = "fake-model"

    def update(self, **changes: Any) -> None:
        """Set fields, converting values (they may come from JSON or a command line) to the field's type."""
        unknown = sorted(set(changes) - set(_FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown fake-server settings {unknown}; known: {sorted(_FIELD_TYPES)}")
        converted: dict[str, Any] = {}
        for key, value in changes.items():
            kind, optional = _FIELD_TYPES[key]
            if value is None and optional:
                converted[key] = None
                continue
            try:
                converted[key] = kind(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"fake-server setting {key}={value!r} is not a valid {getattr(kind, '__name__', 'value')}") from exc
        for key, value in converted.items():
            setattr(self, key, value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if value.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(value)
    return bool(value)


# field → (type, may be None); kept beside the dataclass so that update() can validate run-time changes.
_FIELD_TYPES: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "latency": (float, False),
    "jitter": (float, False),
    "rpm": (float, True),
    "rpm_burst": (float, False),
    "fail_next": (int, False),
    "fail_status": (int, False),
    "retry_after": (float, True),
    "hang": (_to_bool, False),
    "hang_seconds": (float, True),
    "reply": (str, False),
    "model": (str, False),
}


@dataclass
class _Stats:
    total: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    timestamps: list[float] = field(default_factory=list)  # time.monotonic() at arrival (system-wide clock)
    prompts: dict[str, int] = field(default_factory=dict)  # last user message → times received
    in_flight: int = 0
    max_in_flight: int = 0

    def clear(self) -> None:
        """Forget everything but the requests still in flight (their handlers will decrement in_flight)."""
        self.total = 0
        self.by_status.clear()
        self.timestamps.clear()
        self.prompts.clear()
        self.max_in_flight = self.in_flight

    def snapshot(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_status": dict(self.by_status),
            "timestamps": list(self.timestamps),
            "prompts": dict(self.prompts),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
        }


class _FakeState:
    """Behaviour and counters of one server; lives on the server's event loop."""

    def __init__(self, behaviour: FakeBehaviour) -> None:
        self.initial = dataclasses.replace(behaviour)
        self.behaviour = behaviour
        self.stats = _Stats()
        self._ids = 0
        self._bucket = behaviour.rpm_burst
        self._bucket_at = time.monotonic()
        self.stopping: asyncio.Event | None = None  # created on the loop

    def reset(self, behaviour: bool = False) -> None:
        self.stats.clear()
        if behaviour:
            # Mutate in place: owners hold a reference to the behaviour object.
            for f in dataclasses.fields(self.initial):
                setattr(self.behaviour, f.name, getattr(self.initial, f.name))
        self._bucket = self.behaviour.rpm_burst
        self._bucket_at = time.monotonic()

    def next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    def rate_check(self, now: float) -> float | None:
        """None when the server-side rpm allows this request, else the seconds until it would."""
        rpm = self.behaviour.rpm
        if not rpm:
            return None
        rate = rpm / 60.0
        self._bucket = min(self.behaviour.rpm_burst, self._bucket + (now - self._bucket_at) * rate)
        self._bucket_at = now
        if self._bucket >= 1.0:
            self._bucket -= 1.0
            return None
        return (1.0 - self._bucket) / rate


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _words(text: str) -> int:
    return len(text.split())


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = "rate_limit_error" if status == 429 else ("server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type=_JSON, headers=headers)


def _retry_headers(seconds: float | None) -> dict[str, str] | None:
    if seconds is None:
        return None
    # Retry-After is integral per HTTP; retry-after-ms (sent by OpenAI too) carries the precise value.
    return {"Retry-After": str(max(0, math.ceil(seconds))), "retry-after-ms": str(int(seconds * 1000))}


def _instance(schema: dict[str, Any], text: str, defs: dict[str, Any], depth: int = 0) -> Any:
    """A small value that satisfies a JSON schema, so structured-output pipelines can run against the fake."""
    if depth > 8:
        return None
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _instance(defs.get(name, {}), text, defs, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            options = [s for s in schema[key] if s.get("type") != "null"] or schema[key]
            return _instance(options[0], text, defs, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {k: _instance(v, text, defs, depth + 1) for k, v in props.items()}
    if kind == "array":
        return [_instance(schema.get("items", {}), text, defs, depth + 1)]
    if kind == "integer":
        return int(schema.get("minimum", 0))
    if kind == "number":
        return float(schema.get("minimum", 0.0))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return text


def _structured_reply(response_format: Any, prompt: str) -> str | None:
    if not isinstance(response_format, dict):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return json.dumps({"echo": prompt})
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") or {}
        return json.dumps(_instance(schema, prompt, schema.get("$defs", {})))
    return None


STATE_KEY: web.AppKey[_FakeState] = web.AppKey("fake_llm_state", _FakeState)


def fake_embedding(text: str, dimensions: int | None = None) -> list[float]:
    """The fake server's vector for a text: its length, its vowels, its spaces, then 0.5 (``dimensions`` cuts)."""
    vector = [float(len(text)), float(sum(c in "aeiou" for c in text.lower())), float(text.count(" ")), 0.5]
    return vector[:dimensions] if dimensions else vector


def build_app(state: _FakeState | None = None, behaviour: FakeBehaviour | None = None) -> web.Application:
    """The aiohttp application; ``state`` is shared with the owner so that it can configure and read it."""
    st = state if state is not None else _FakeState(behaviour or FakeBehaviour())

    async def on_startup(_: web.Application) -> None:
        st.stopping = asyncio.Event()

    async def gate(prompt: str) -> web.Response | None:
        """Apply scripted failures, markers, rate limit, hang and latency; a Response means: answer with it."""
        b = st.behaviour
        latency = b.latency
        if b.fail_next > 0:
            b.fail_next -= 1
            status = b.fail_status
            headers = _retry_headers(b.retry_after) if status == 429 else None
            return _error(status, f"scripted failure ({status})", headers)
        hang = b.hang
        if "[[" in prompt:
            for marker in _MARKER.findall(prompt):
                name, _, arg = marker.partition(":")
                if name == "status":
                    status = int(arg)
                    headers = _retry_headers(b.retry_after) if status == 429 else None
                    return _error(status, f"marker asked for status {status}", headers)
                if name == "latency":
                    latency = float(arg)
                elif name == "hang":
                    hang = True
        wait = st.rate_check(time.monotonic())
        if wait is not None:
            return _error(429, f"rate limit of {b.rpm:g} requests per minute exceeded", _retry_headers(wait))
        if hang:
            assert st.stopping is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(st.stopping.wait(), b.hang_seconds)
            if st.stopping.is_set():
                return _error(503, "server shutting down")
        elif latency > 0 or b.jitter > 0:
            await asyncio.sleep(latency + (random.random() * b.jitter if b.jitter else 0.0))
        return None

    async def guarded(
        request: web.Request,
        handler: Callable[[web.Request, dict[str, Any]], Coroutine[Any, Any, web.StreamResponse]],
    ) -> web.StreamResponse:
        s = st.stats
        s.total += 1
        s.timestamps.append(time.monotonic())
        s.in_flight += 1
        if s.in_flight > s.max_in_flight:
            s.max_in_flight = s.in_flight
        status = 499  # stays so when the client went away and aiohttp cancelled the handler (nginx's code)
        try:
            try:
                data = json.loads(await request.read())
                if not isinstance(data, dict):
                    raise ValueError("body must be a JSON object")
            except ValueError as exc:
                status = 400
                return _error(400, f"invalid JSON body: {exc}")
            resp = await handler(request, data)
            status = resp.status
            return resp
        finally:
            s.in_flight -= 1
            key = str(status)
            s.by_status[key] = s.by_status.get(key, 0) + 1

    def count_prompt(prompt: str) -> None:
        prompts = st.stats.prompts
        prompts[prompt] = prompts.get(prompt, 0) + 1

    async def chat_impl(request: web.Request, data: dict[str, Any]) -> web.StreamResponse:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty list")
        prompt = ""
        for m in reversed(messages):
            if isinstance(m, dict) and m.get("role") == "user":
                prompt = _text_of(m.get("content"))
                break
        count_prompt(prompt)
        early = await gate(prompt)
        if early is not None:
            return early
        b = st.behaviour
        model = data.get("model") or b.model
        content = _structured_reply(data.get("response_format"), prompt)
        if content is None:
            content = b.reply.replace("{prompt}", prompt).replace("{model}", str(model))
        p_tok = sum(_words(_text_of(m.get("content"))) for m in messages if isinstance(m, dict))
        c_tok = _words(content)
        usage = {"prompt_tokens": p_tok, "completion_tokens": c_tok, "total_tokens": p_tok + c_tok}
        rid = st.next_id("chatcmpl")
        created = int(time.time())
        if data.get("stream"):
            return await stream_chat(request, data, rid, created, model, content, usage)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON)

    async def stream_chat(
        request: web.Request,
        data: dict[str, Any],
        rid: str,
        created: int,
        model: str,
        content: str,
        usage: dict[str, int],
    ) -> web.StreamResponse:
        # One role chunk, one chunk per word, a finish chunk, optional usage chunk, then [DONE]: enough for
        # clients that parse Server-Sent Events the way OpenAI sends them.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        await resp.write(chunk({"role": "assistant", "content": ""}))
        for i, word in enumerate(content.split(" ")):
            await resp.write(chunk({"content": word if i == 0 else " " + word}))
        await resp.write(chunk({}, "stop"))
        if (data.get("stream_options") or {}).get("include_usage"):
            tail = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def completions_impl(_: web.Request, data: dict[str, Any]) -> web.StreamResponse:
        prompts = data.get("prompt")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            return _error(400, "'prompt' must be a string or a non-empty list of strings")
        count_prompt(prompts[-1])
        early = await gate(prompts[-1])
        if early is not None:
            return early
        b = st.behaviour
        model = data.get("model") or b.model
        texts = [b.reply.replace("{prompt}", p).replace("{model}", str(model)) for p in prompts]
        p_tok = sum(_words(p) for p in prompts)
        c_tok = sum(_words(t) for t in texts)
        body = {
            "id": st.next_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {"index": i, "text": t, "finish_reason": "stop", "logprobs": None} for i, t in enumerate(texts)
            ],
            "usage": {"prompt_tokens": p_tok, "completion_tokens": c_tok, "total_tokens": p_tok + c_tok},
        }
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON)

    async def embeddings_impl(_: web.Request, data: dict[str, Any]) -> web.StreamResponse:
        inputs = data.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str | list) and x for x in inputs):
            return _error(400, "'input' must be a string, a list of strings or token ids, not empty")
        texts = [x if isinstance(x, str) else " ".join(map(str, x)) for x in inputs]
        count_prompt(texts[-1])
        early = await gate(texts[-1])
        if early is not None:
            return early
        dimensions = data.get("dimensions")
        rows = []
        for index, text in enumerate(texts):
            vector = fake_embedding(text, dimensions if isinstance(dimensions, int) else None)
            if data.get("encoding_format") == "base64":
                encoded: Any = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            else:
                encoded = vector
            rows.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(_words(t) for t in texts)
        body = {"object": "list", "data": rows, "model": data.get("model") or st.behaviour.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await guarded(request, chat_impl)

    async def embeddings(request: web.Request) -> web.StreamResponse:
        return await guarded(request, embeddings_impl)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await guarded(request, completions_impl)

    async def models(_: web.Request) -> web.Response:
        model = st.behaviour.model
        body = {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "fake"}]}
        return web.json_response(body)

    async def control(request: web.Request) -> web.Response:
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise ValueError("send a JSON object of settings")
            st.behaviour.update(**changes)
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response(dataclasses.asdict(st.behaviour))

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(st.stats.snapshot())

    async def reset(request: web.Request) -> web.Response:
        body = await request.read()
        opts = json.loads(body) if body.strip() else {}
        st.reset(behaviour=bool(opts.get("behaviour", False)))
        return web.json_response({"ok": True})

    app = web.Application()
    app[STATE_KEY] = st
    app.on_startup.append(on_startup)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/_control", control)
    app.router.add_get("/_stats", stats)
    app.router.add_post("/_reset", reset)
    return app


# -- running it ------------------------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency, but keep the fake usable without it
        return asyncio.new_event_loop()


def _runner(app: web.Application) -> web.AppRunner:
    # No access log (it costs more than the handler); cancel handlers whose client hung up; stop fast.
    return web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)


class FakeLLMServer:
    """The fake server on a background thread with its own event loop.

    ``start()`` returns the base URL (``http://127.0.0.1:PORT/v1``); use it as ``with``/``async with`` too.
    ``stats()``, ``configure(**kw)`` and ``reset()`` act directly on the running server.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, latency: float = 0.0, **behaviour: Any) -> None:
        self.host = host
        self.port = port
        self.behaviour = FakeBehaviour(latency=latency)
        self.behaviour.update(**behaviour)
        self._state = _FakeState(self.behaviour)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    @property
    def url(self) -> str:
        """The server root (without ``/v1``), for ``/_stats`` and friends."""
        if self.base_url is None:
            raise RuntimeError("the fake server is not running; call start() first")
        return self.base_url[: -len("/v1")]

    def start(self) -> str:
        if self._thread is not None and self.base_url is not None:
            return self.base_url
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = _new_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(sock))
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-llm-server:{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(15) or failure:
            self._thread = None
            raise RuntimeError(f"fake LLM server failed to start on {self.host}:{self.port}: {failure}")
        self.base_url = _base_url(self.host, self.port)
        return self.base_url

    async def _serve(self, sock: socket.socket) -> None:
        self._runner = _runner(build_app(self._state))
        await self._runner.setup()
        await web.SockSite(self._runner, sock, backlog=2048).start()

    async def _shutdown(self) -> None:
        if self._state.stopping is not None:
            self._state.stopping.set()  # release hung handlers
        await asyncio.sleep(0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = None
        self._loop = None
        self.base_url = None

    def _on_loop(self, fn: Callable[[], T]) -> T:
        # Stats and behaviour belong to the server thread; touch them there to avoid racing the handlers.
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or threading.current_thread() is thread:
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=10)

    def stats(self) -> dict[str, Any]:
        """``total``, ``by_status`` (str status → count), ``timestamps`` (monotonic arrival times), ``prompts``
        (last user message → count), ``in_flight`` and ``max_in_flight``."""
        return self._on_loop(self._state.stats.snapshot)

    def configure(self, **changes: Any) -> None:
        """Change behaviour now, e.g. ``configure(fail_next=2, fail_status=503)`` or ``configure(rpm=60)``."""
        self._on_loop(lambda: self._state.behaviour.update(**changes))

    def reset(self, behaviour: bool = False) -> None:
        """Clear stats (and restore the start behaviour when ``behaviour`` is true)."""
        self._on_loop(lambda: self._state.reset(behaviour=behaviour))

    def __enter__(self) -> FakeLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeLLMServer:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            with contextlib.suppress(Exception):
                self.stop()


# -- subprocess mode ------------------------------------------------------------------------------------------

_CLI_FIELDS: dict[str, type] = {
    "latency": float,
    "jitter": float,
    "rpm": float,
    "rpm_burst": float,
    "fail_next": int,
    "fail_status": int,
    "retry_after": float,
    "hang_seconds": float,
    "reply": str,
    "model": str,
}


async def _serve_forever(host: str, port: int, behaviour: FakeBehaviour) -> None:
    runner = _runner(build_app(_FakeState(behaviour)))
    await runner.setup()
    sock = _bind(host, port)
    await web.SockSite(runner, sock, backlog=2048).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {_base_url(host, sock.getsockname()[1])}", flush=True)
    await stop.wait()
    state = runner.app[STATE_KEY]
    if state.stopping is not None:
        state.stopping.set()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.testing.fake_llm_server",
        description="OpenAI-compatible fake LLM server; prints 'READY <base_url>' when listening.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    for name, kind in _CLI_FIELDS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None)
    parser.add_argument("--hang", action="store_true", help="never answer (or after --hang-seconds)")
    args = parser.parse_args(argv)
    behaviour = FakeBehaviour(hang=args.hang)
    behaviour.update(**{k: getattr(args, k) for k in _CLI_FIELDS if getattr(args, k) is not None})
    try:
        import uvloop

        uvloop.run(_serve_forever(args.host, args.port, behaviour))
    except ImportError:  # pragma: no cover
        asyncio.run(_serve_forever(args.host, args.port, behaviour))


def start_fake_server_process(
    latency: float = 0.0, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 20.0, **behaviour: Any
) -> tuple[subprocess.Popen[str], str]:
    """Start the fake server as a separate process (its own core, for load tests); returns (process, base_url).

    Stop it with ``proc.terminate(); proc.wait()`` (or :func:`stop_fake_server_process`).
    """
    cmd = [sys.executable, "-m", "app.testing.fake_llm_server", "--host", host, "--port", str(port)]
    cmd += ["--latency", str(latency)]
    for key, value in behaviour.items():
        if key == "hang":
            if value:
                cmd.append("--hang")
        elif key in _CLI_FIELDS:
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        else:
            raise ValueError(f"unknown fake-server setting {key!r}; known: {sorted([*_CLI_FIELDS, 'hang'])}")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"fake LLM server process did not become ready (exit code {proc.returncode}); "
                f"run {' '.join(cmd)} by hand to see why"
            )
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
        if ready:
            line = proc.stdout.readline()
            if line.startswith("READY "):
                return proc, line.split(" ", 1)[1].strip()


def stop_fake_server_process(proc: subprocess.Popen[str], timeout: float = 5.0) -> None:
    """Terminate a process from :func:`start_fake_server_process` and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


if __name__ == "__main__":
    main()
