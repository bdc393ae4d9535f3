"""A backend that forwards to any OpenAI-compatible server (OpenAI, vLLM, another inf-engine) over aiohttp.

Every request is sent upstream as a streaming request (``stream_options.include_usage``), whatever the
client asked for, and the upstream SSE chunks are turned into :class:`GenerationChunk` increments; the server
in front shapes them back into the client's response. Chat stays chat upstream (the upstream applies its own
template); completions keep their prompt (text or token ids). vLLM's extra sampling fields are sent only when
set away from their defaults, so strict servers (OpenAI) do not reject them. Closing a stream closes the
upstream connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from app.engine.core.sampling_params import SamplingParams
from app.serving.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    ClosingStream,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    InvalidRequestError,
    ModelCard,
    QueueFullError,
    SequenceDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)
_HEALTH_TTL = 1.0  # seconds a health answer is reused (probes may come often)


class OpenAIProxyBackend(Backend):
    name = "openai"
    supports_structured_outputs = True  # forwarded: the upstream constrains (or refuses)
    parses_tool_calls = True  # tools are forwarded; the upstream reports tool_calls

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        upstream_model: str | None = None,
        served_model_name: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(served_model_name=served_model_name or upstream_model or "")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.upstream_model = upstream_model
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._health: tuple[float, HealthStatus] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAIProxyBackend:
        if not settings.openai_base_url:
            raise ValueError(
                "the openai backend needs the upstream URL: set INF_ENGINE_OPENAI_BASE_URL "
                "(e.g. https://api.openai.com/v1) and usually INF_ENGINE_OPENAI_API_KEY"
            )
        return cls(
            base_url=settings.openai_base_url,
            api_key=settings.openai_api_key,
            upstream_model=settings.openai_model or settings.model,
            served_model_name=settings.served_model_name,
            timeout=settings.upstream_timeout,
        )

    @property
    def root_url(self) -> str:
        """The server root (vLLM's /health, /tokenize live there, beside /v1)."""
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    # ------------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=10),
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                read_bufsize=1 << 21,
            )
        if self.upstream_model is None:
            cards = await self._upstream_models()
            if not cards:
                raise BackendUnavailableError(f"the upstream server at {self.base_url} lists no models")
            self.upstream_model = cards[0]["id"]
        if not self.served_model_name:
            self.served_model_name = str(self.upstream_model)
        if self.max_model_len is None:
            try:
                cards = await self._upstream_models()
            except BackendError as exc:  # the model is known: serve, and let /health report the upstream
                log.warning("the upstream server at %s does not answer yet: %s", self.base_url, exc.message)
                cards = []
            for card in cards:
                if card.get("id") == self.upstream_model and isinstance(card.get("max_model_len"), int):
                    self.max_model_len = card["max_model_len"]

    async def stop(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise BackendUnavailableError(f"the {self.name} backend is not started")
        return self._session

    async def _upstream_models(self) -> list[dict[str, Any]]:
        data = await self._get_json(f"{self.base_url}/models")
        return [c for c in data.get("data", []) if isinstance(c, dict) and "id" in c]

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            async with self._http().get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise _upstream_error(resp.status, body, self.base_url)
                data = orjson.loads(body)
                return data if isinstance(data, dict) else {}
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise BackendUnavailableError(f"cannot reach the upstream server at {url}: {exc!r}") from None

    async def health(self) -> HealthStatus:
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < _HEALTH_TTL:
            return self._health[1]
        status = await self._probe()
        self._health = (now, status)
        return status

    async def _probe(self) -> HealthStatus:
        session = self._session
        if session is None:
            return HealthStatus(False, "the backend is not started")
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with session.get(f"{self.root_url}/health", timeout=timeout) as resp:
                if resp.status == 200:
                    return HealthStatus(True)
                if resp.status != 404:
                    return HealthStatus(False, f"upstream /health answered {resp.status}")
            async with session.get(f"{self.base_url}/models", timeout=timeout) as resp:
                ok = resp.status == 200
                return HealthStatus(ok, "ok" if ok else f"upstream /models answered {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return HealthStatus(False, f"cannot reach the upstream server: {exc!r}")

    async def models(self) -> list[ModelCard]:
        return [
            ModelCard(
                id=self.served_model_name,
                created=self.created,
                owned_by="upstream",
                root=str(self.upstream_model),
                max_model_len=self.max_model_len,
            )
        ]

    # ------------------------------------------------------------------------------------------ text
    async def _post_json(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.root_url}{path}"
        try:
            async with self._http().post(url, data=orjson.dumps(payload), headers=_JSON_HEADERS) as resp:
                body = await resp.read()
                if resp.status == 404:
                    raise BackendError(
                        f"the upstream server at {self.root_url} has no {path} endpoint (vLLM has one)",
                        status=501,
                        type="not_implemented",
                    )
                if resp.status != 200:
                    raise _upstream_error(resp.status, body, self.base_url)
                data = orjson.loads(body)
                return data if isinstance(data, dict) else {}
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise BackendUnavailableError(f"cannot reach the upstream server at {url}: {exc!r}") from None

    async def tokenize(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        payload: dict[str, Any] = {"model": self.upstream_model, "add_special_tokens": add_special_tokens}
        if messages is not None:
            payload.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
        else:
            payload["prompt"] = prompt or ""
        data = await self._post_json("/tokenize", payload)
        return [int(t) for t in data.get("tokens", [])]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        data = await self._post_json("/detokenize", {"model": self.upstream_model, "tokens": list(token_ids)})
        return str(data.get("prompt", ""))

    # ------------------------------------------------------------------------------------------ generation
    def payload(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        """The upstream path and body for ``request``."""
        p = request.params
        body: dict[str, Any] = {"model": self.upstream_model, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if request.messages is not None:
            path = "/chat/completions"
            body["messages"] = request.messages
            if p.max_tokens is not None:
                body["max_completion_tokens"] = p.max_tokens
            if p.logprobs is not None:
                body["logprobs"] = True
                body["top_logprobs"] = p.logprobs
        else:
            path = "/completions"
            body["prompt"] = request.prompt
            body["max_tokens"] = p.max_tokens
            if p.logprobs is not None:
                body["logprobs"] = p.logprobs
            if p.best_of is not None:
                body["best_of"] = p.best_of
        body.update(_openai_fields(p))
        body.update(_vllm_extras(p, request))
        body.update(request.upstream_fields)  # response_format, structured_outputs, tools, ... as sent
        return path, body

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        path, body = self.payload(request)
        url = f"{self.base_url}{path}"
        try:
            resp = await self._http().post(url, data=orjson.dumps(body), headers=_JSON_HEADERS)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailableError(f"cannot reach the upstream server at {url}: {exc!r}") from None
        if resp.status != 200:
            try:
                raw = await resp.read()
            finally:
                resp.release()
            raise _upstream_error(resp.status, raw, self.base_url)
        return ClosingStream(self._stream(request, resp), resp.close)

    async def _stream(
        self, request: GenerationRequest, resp: aiohttp.ClientResponse
    ) -> AsyncIterator[GenerationChunk]:
        chat = request.is_chat
        done = False
        try:
            async for raw_line in resp.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    event = orjson.loads(data)
                except orjson.JSONDecodeError:
                    raise BackendError(
                        f"the upstream server sent an event that is not JSON: {data[:200]!r}", status=502,
                        type="upstream_error",
                    ) from None  # fmt: skip
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    err = (
                        event["error"]
                        if isinstance(event["error"], dict)
                        else {"message": str(event["error"])}
                    )
                    raise BackendError(
                        f"the upstream server failed mid-stream: {err.get('message')}",
                        status=502,
                        type="upstream_error",
                    )
                deltas = [
                    d
                    for choice in event.get("choices") or []
                    if isinstance(choice, dict)
                    and (
                        (d := _delta(choice, chat)).text
                        or d.token_ids
                        or d.logprobs
                        or d.finish_reason
                        or d.tool_calls
                    )
                ]
                usage = _usage(event.get("usage"))
                if deltas:
                    yield GenerationChunk(request.request_id, deltas)
                if usage is not None and not event.get("choices"):
                    done = True
                    yield GenerationChunk(
                        request.request_id,
                        [],
                        num_prompt_tokens=usage.prompt_tokens,
                        finished=True,
                        usage=usage,
                    )
            if not done:
                yield GenerationChunk(request.request_id, [], finished=True)
            done = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailableError(f"the upstream stream broke: {exc!r}") from None
        finally:
            if done:
                resp.release()
            else:
                resp.close()  # drop the connection: the upstream sees the disconnect and aborts


_JSON_HEADERS = {"Content-Type": "application/json"}


def _openai_fields(p: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"n": p.n, "temperature": p.temperature, "top_p": p.top_p}
    if p.stop_strings:
        body["stop"] = p.stop_strings
    if p.seed is not None:
        body["seed"] = p.seed
    if p.presence_penalty:
        body["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        body["frequency_penalty"] = p.frequency_penalty
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    return body


def _vllm_extras(p: SamplingParams, request: GenerationRequest) -> dict[str, Any]:
    """vLLM's fields, only where they differ from the default (OpenAI rejects unknown fields)."""
    extras: dict[str, Any] = {}
    if p.top_k is not None and p.top_k > 0:
        extras["top_k"] = p.top_k
    if p.min_p:
        extras["min_p"] = p.min_p
    if p.repetition_penalty != 1.0:
        extras["repetition_penalty"] = p.repetition_penalty
    if p.min_tokens:
        extras["min_tokens"] = p.min_tokens
    if p.ignore_eos:
        extras["ignore_eos"] = True
    if p.stop_token_ids:
        extras["stop_token_ids"] = list(p.stop_token_ids)
    if not p.skip_special_tokens:
        extras["skip_special_tokens"] = False
    if p.include_stop_str_in_output:
        extras["include_stop_str_in_output"] = True
    if request.priority:
        extras["priority"] = request.priority
    if request.is_chat and not request.add_generation_prompt:
        extras["add_generation_prompt"] = False
    if request.chat_template_kwargs:
        extras["chat_template_kwargs"] = request.chat_template_kwargs
    return extras


def _delta(choice: dict[str, Any], chat: bool) -> SequenceDelta:
    index = int(choice.get("index") or 0)
    tool_calls = None
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        raw_calls = delta.get("tool_calls")
        if isinstance(raw_calls, list):
            tool_calls = [c for c in raw_calls if isinstance(c, dict)] or None
    else:
        text = choice.get("text") or ""
    return SequenceDelta(
        index,
        text=text,
        token_ids=[int(t) for t in choice.get("token_ids") or []],
        logprobs=_logprobs(choice.get("logprobs"), chat),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        tool_calls=tool_calls,
    )


def _logprobs(raw: Any, chat: bool) -> list[TokenLogprob] | None:
    if not isinstance(raw, dict):
        return None
    if chat:
        return [
            TokenLogprob(
                str(e.get("token", "")),
                float(e.get("logprob", 0.0)),
                None,
                tuple(
                    TopLogprob(str(t.get("token", "")), float(t.get("logprob", 0.0)))
                    for t in e.get("top_logprobs") or []
                ),
            )
            for e in raw.get("content") or []
        ]
    tokens = raw.get("tokens") or []
    values = raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or []
    out = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        value = values[i] if i < len(values) and values[i] is not None else 0.0
        alternatives = sorted(top.items(), key=lambda kv: -kv[1])
        out.append(
            TokenLogprob(
                str(token), float(value), None, tuple(TopLogprob(t, float(v)) for t, v in alternatives)
            )
        )
    return out


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    try:
        return Usage(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0))
    except (TypeError, ValueError):
        return None


def _upstream_error(status: int, body: bytes, base_url: str) -> BackendError:
    message, param, code = body.decode("utf-8", "replace")[:500], None, None
    try:
        data = orjson.loads(body)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            param, code = err.get("param"), err.get("code")
        elif isinstance(err, str):
            message = err
        elif isinstance(data, dict) and "message" in data:
            message = str(data["message"])
    except orjson.JSONDecodeError:
        pass
    if status in (400, 422):
        return InvalidRequestError(message, param=param, code=code)
    if status == 429:
        return QueueFullError(f"the upstream server is at capacity: {message}")
    if status in (401, 403):
        return BackendError(
            f"the upstream server at {base_url} rejected our credentials ({status}): {message}. "
            "Check INF_ENGINE_OPENAI_API_KEY.",
            status=502,
            type="upstream_error",
        )
    if status == 404:
        return BackendError(
            f"the upstream server at {base_url} answered 404: {message}. Check INF_ENGINE_OPENAI_MODEL "
            "and that the URL ends with /v1.",
            status=502,
            type="upstream_error",
        )
    return BackendError(
        f"the upstream server answered {status}: {message}", status=502, type="upstream_error"
    )
