"""The OpenAI-compatible endpoints' logic: requests in, OpenAI-shaped bodies or SSE byte chunks out.

For each request: check the model, map fields to ``SamplingParams``, open one backend stream per prompt
(backend errors raise *before* anything is sent), and either collect the streams into one response body or
turn them into ``chat.completion.chunk`` / ``text_completion`` SSE events ending with ``data: [DONE]``.
Streaming responses are primed: the first backend chunk is awaited before the response starts, so a full
queue or a bad prompt is an HTTP status, not an error event. Closing a stream (client gone) closes every
backend stream under it, which aborts the requests in the engine.

Constrained output comes from the request's own fields (``structured``) or from its tools (``tools``: a
schema for a forced call, a structural tag for ``auto``), never both; chat responses carry tool calls as
``chat`` shapes them. A backend without structured outputs gets a 400 naming the field instead.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from app.engine.core.sampling_params import SamplingParams
from app.serving.activations import prompt_activations
from app.serving.backends.base import (
    Backend,
    BackendError,
    ClosingStream,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
)
from app.serving.chat import chat_body, chat_head, chat_messages, chat_sse
from app.serving.embeddings import EmbeddingService
from app.serving.errors import bad_request, error_body, model_not_found
from app.serving.metrics import ServingMetrics
from app.serving.params import (
    chat_sampling_params,
    completion_prompts,
    completion_sampling_params,
    reject_unsupported,
)
from app.serving.pooling import DecoderPooling
from app.serving.responses import (
    DONE,
    Choice,
    UsageTally,
    aclose,
    collect,
    completion_logprobs,
    sse,
    usage_body,
)
from app.serving.schemas import (
    ActivationsRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from app.serving.structured import Structure, request_structure, upstream_structure_fields
from app.serving.tools import ToolPlan, combined_structure, plan_tools, upstream_tool_fields

T = TypeVar("T")
_END = object()
_aclose = aclose


# ---------------------------------------------------------------------------------------------- streams
async def _merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _aclose(streams[0])
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await _aclose(stream)


async def _chain(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await _aclose(rest)


async def _prime(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Await the first item now (so errors surface before a response starts); the rest stays lazy."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return stream
    except BaseException:
        await _aclose(stream)
        raise
    return _chain(first, stream)


# ---------------------------------------------------------------------------------------------- requests
def check_hidden_states_supported(backend: Backend, params: SamplingParams) -> None:
    """A 400 for interventions on a backend that runs another engine."""
    if params.interventions and not backend.supports_hidden_states:
        raise bad_request(f"interventions need the native backend (our engine); this server runs the "
                          f"{backend.name} backend", "interventions")


def check_structure_supported(backend: Backend, structure: Structure | None) -> None:
    """A 400 naming the field when ``structure`` constrains the output and ``backend`` cannot."""
    if structure is not None and not backend.supports_structured_outputs:
        raise bad_request(
            f"structured outputs ({structure.param}) need the native or vllm backend; this server runs "
            f"the {backend.name} backend",
            structure.param,
        )


def chat_generation_request(
    backend: Backend, rid: str, req: ChatCompletionRequest
) -> tuple[GenerationRequest, ToolPlan | None]:
    """A checked chat request as ``backend`` takes it, and its tool plan (how its tool calls are read back):
    sampling params, the constraint of its ``response_format`` / ``structured_outputs`` / tools, and the fields
    a proxy forwards. The route and the pipeline's in-process client (``app.serving.embedded``) share it."""
    reject_unsupported(req)  # before the tool fields: a 'functions' request is told about 'functions'
    plan = plan_tools(req, upstream=backend.parses_tool_calls, constrain=backend.supports_structured_outputs)
    structure = combined_structure(plan, request_structure(req))
    check_structure_supported(backend, structure)
    params = chat_sampling_params(req, structure)
    check_hidden_states_supported(backend, params)
    request = GenerationRequest(
        rid,
        params,
        messages=chat_messages(req.messages),
        add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        priority=req.priority,
        tools=(plan.prompt_tools or None) if plan is not None and not backend.parses_tool_calls else None,
        structured_param=structure.param if structure is not None else None,
        upstream_fields={**upstream_structure_fields(req), **upstream_tool_fields(req)},
    )
    return request, plan


# ---------------------------------------------------------------------------------------------- serving
class OpenAIServing:
    """Everything behind the OpenAI routes, for one backend."""

    def __init__(self, backend: Backend, metrics: ServingMetrics | None = None,
                 embeddings: EmbeddingService | None = None, pooler_config: Mapping[str, Any] | None = None) -> None:
        self.backend = backend
        self.metrics = metrics or ServingMetrics(backend.served_model_name, backend.stats)
        self.embeddings = embeddings  # the embedding model beside the chat model (/v1/embeddings), if any
        # the chat model's own embeddings (vLLM's --pooler-config), if it pools
        self.pooling = None if pooler_config is None else DecoderPooling(
            backend, self._open, pooling_type=pooler_config["pooling_type"], normalize=pooler_config["normalize"])

    @property
    def model_names(self) -> list[str]:
        return [self.backend.served_model_name]

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.model_names:
            return self.backend.served_model_name
        if self.embeddings is not None and model == self.embeddings.name:
            raise bad_request(f"model {model} is an embedding model: send it to /v1/embeddings; this route's "
                              f"model is {self.backend.served_model_name}", "model")
        raise model_not_found(model, self.model_names)

    async def embed(self, req: EmbeddingRequest) -> dict[str, Any]:
        """``/v1/embeddings``: the embedding model's vectors (a 400 for a model that does not pool)."""
        service = self.embeddings
        chat_model = req.model is None or req.model in self.model_names
        if self.pooling is not None and (service is None or (req.model is not None and chat_model)):
            return await self.pooling.embed(req)
        if service is None:
            raise bad_request(f"model {req.model or self.backend.served_model_name} does not pool: this server "
                              "serves no embedding model (start it with --embedding-model all-MiniLM-L6-v2, or "
                              "set INF_ENGINE_EMBEDDING_MODEL)", "model")
        if req.model is not None and req.model != service.name:
            if req.model in self.model_names:
                raise bad_request(f"model {req.model} generates text and does not pool; embeddings come from "
                                  f"{service.name}", "model")
            raise model_not_found(req.model, [service.name])
        return await service.embed(req)

    async def activations(self, req: ActivationsRequest) -> dict[str, Any]:
        """``/v1/activations``: the prompt's residual stream after the layers asked for."""
        self.check_model(req.model)
        return await prompt_activations(self.backend, self._open, req)

    # -------------------------------------------------------------------------------------- simple routes
    async def health(self) -> HealthStatus:
        try:
            return await self.backend.health()
        except Exception as exc:
            return HealthStatus(False, f"health check failed: {exc}")

    async def list_models(self) -> dict[str, Any]:
        cards = await self.backend.models()
        pooling = [self.embeddings.card()] if self.embeddings is not None and self.embeddings.model is not None else []
        return {
            "object": "list",
            "data": [
                {
                    "id": c.id,
                    "object": "model",
                    "created": c.created,
                    "owned_by": c.owned_by,
                    "root": c.root,
                    "parent": None,
                    "max_model_len": c.max_model_len,
                }
                for c in cards
            ] + pooling,
        }

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            tokens = await self.backend.tokenize(
                messages=chat_messages(req.messages),
                add_special_tokens=bool(req.add_special_tokens),
                add_generation_prompt=req.add_generation_prompt,
            )
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await self.backend.tokenize(prompt=req.prompt, add_special_tokens=add)
        return {
            "count": len(tokens),
            "max_model_len": self.backend.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        return {"prompt": await self.backend.detokenize(req.tokens)}

    # -------------------------------------------------------------------------------------- generation
    async def _open(self, requests: Sequence[GenerationRequest]) -> list[AsyncIterator[GenerationChunk]]:
        streams: list[AsyncIterator[GenerationChunk]] = []
        try:
            for request in requests:
                raw = await self.backend.generate(request)
                streams.append(ClosingStream(self._tracked(raw, request.arrival_time), partial(_aclose, raw)))
        except BaseException:
            for stream in streams:
                await _aclose(stream)
            raise
        return streams

    async def _tracked(
        self, stream: AsyncIterator[GenerationChunk], arrival: float
    ) -> AsyncIterator[GenerationChunk]:
        """Observe the vLLM per-request metrics as chunks pass; always close the backend stream."""
        m = self.metrics
        last: float | None = None
        prompt = generated = 0
        reason: str | None = None
        try:
            async for chunk in stream:
                now = time.monotonic()
                if any(d.token_ids or d.text for d in chunk.deltas):
                    if last is None:
                        m.observe_ttft(now - arrival)
                    else:
                        m.observe_itl(now - last)
                    last = now
                if chunk.queue_time is not None:
                    m.observe_queue_time(chunk.queue_time)
                for d in chunk.deltas:
                    generated += len(d.token_ids)
                    reason = d.finish_reason or reason
                if chunk.num_prompt_tokens is not None:
                    prompt = chunk.num_prompt_tokens
                if chunk.usage is not None:
                    prompt, generated = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                if chunk.finished:
                    m.observe_finished(
                        e2e=now - arrival,
                        prompt_tokens=prompt,
                        generation_tokens=generated,
                        reason=reason or "stop",
                    )
                yield chunk
        finally:
            await _aclose(stream)

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[bytes]:
        model = self.check_model(req.model)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        request, plan = chat_generation_request(self.backend, rid, req)
        n = request.params.n
        parser = plan.parser if plan is not None else lambda: None
        (stream,) = await self._open([request])
        head = chat_head(rid, int(time.time()), model)
        want_logprobs = bool(req.logprobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            primed = await _prime(stream)
            return chat_sse(head, primed, n, include_usage, want_logprobs, parser)
        choices = [Choice() for _ in range(n)]
        tally = UsageTally(1)
        try:
            async for chunk in stream:
                tally.add(0, chunk)
                collect(choices, chunk, 0)
        finally:
            await aclose(stream)
        return chat_body(head, choices, usage_body(tally.total()), want_logprobs, parser)

    async def completion(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[bytes]:
        model = self.check_model(req.model)
        structure = request_structure(req)
        check_structure_supported(self.backend, structure)
        params = completion_sampling_params(req, structure)
        check_hidden_states_supported(self.backend, params)
        prompts = completion_prompts(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        upstream = upstream_structure_fields(req)
        param = structure.param if structure is not None else None
        requests = [
            GenerationRequest(
                f"{rid}-{i}", params, prompt=p, priority=req.priority, structured_param=param, upstream_fields=upstream
            )
            for i, p in enumerate(prompts)
        ]
        echo_texts: list[str] = []
        if req.echo:
            for prompt in prompts:
                echo_texts.append(
                    prompt if isinstance(prompt, str) else await self.backend.detokenize(prompt)
                )
        streams = await self._open(requests)
        created = int(time.time())
        n = params.n
        want_logprobs = req.logprobs is not None
        merged = _merge(streams)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            primed = await _prime(merged)
            return self._completion_sse(
                rid, created, model, primed, len(prompts), n, include_usage, want_logprobs, echo_texts
            )
        choices = [Choice() for _ in range(len(prompts) * n)]
        tally = UsageTally(len(prompts))
        try:
            async for p, chunk in merged:
                tally.add(p, chunk)
                collect(choices, chunk, p * n)
        finally:
            await _aclose(merged)
        out = []
        for i, c in enumerate(choices):
            echo = echo_texts[i // n] if echo_texts else ""
            logprobs = completion_logprobs(c.logprobs, len(echo))[0] if want_logprobs else None
            out.append(
                {
                    "index": i,
                    "text": echo + "".join(c.text),
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason or "stop",
                }
            )
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": out,
            "usage": usage_body(tally.total()),
            "system_fingerprint": None,
        }

    async def _completion_sse(
        self,
        rid: str,
        created: int,
        model: str,
        stream: AsyncIterator[tuple[int, GenerationChunk]],
        num_prompts: int,
        n: int,
        include_usage: bool,
        want_logprobs: bool,
        echo_texts: list[str],
    ) -> AsyncIterator[bytes]:
        head: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model}
        head["system_fingerprint"] = None
        if include_usage:
            head["usage"] = None
        tally = UsageTally(num_prompts)
        offsets = [len(echo_texts[i // n]) if echo_texts else 0 for i in range(num_prompts * n)]
        echoed = [not echo_texts] * (num_prompts * n)
        try:
            async for p, chunk in stream:
                tally.add(p, chunk)
                choices = []
                for d in chunk.deltas:
                    index = p * n + d.index
                    entries = d.logprobs if want_logprobs else None
                    text = d.text
                    if not echoed[index]:
                        echoed[index] = True
                        text = echo_texts[p] + text
                    if not (text or d.finish_reason or entries):
                        continue
                    logprobs = None
                    if want_logprobs:
                        logprobs, offsets[index] = completion_logprobs(entries or [], offsets[index])
                    choices.append(
                        {"index": index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
                    )
                if choices:
                    yield sse({**head, "choices": choices})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_body(tally.total())})
        except BackendError as exc:
            yield sse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
        finally:
            await _aclose(stream)
        yield DONE


def model_card(listing: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The card of ``model_id`` in a ``/v1/models`` listing (``GET /v1/models/{id}``); 404 when it is not served."""
    cards: list[dict[str, Any]] = listing.get("data", [])
    for card in cards:
        if card.get("id") == model_id:
            return card
    raise model_not_found(model_id, [str(c.get("id")) for c in cards])
