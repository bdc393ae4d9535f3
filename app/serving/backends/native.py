"""Our own engine in this process: :class:`app.engine.async_engine.AsyncEngine` behind the backend interface.

The backend renders chat templates and checks lengths with the engine's tokenizer, queues the token ids with
``AsyncEngine.add_request`` (invalid input and a full waiting queue fail there, before any output), and turns
the engine's cumulative ``RequestOutput`` objects into increments. Closing the stream aborts the request in
the engine, which frees its KV-cache blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from app.serving.backends.base import (
    BackendUnavailableError,
    ClosingStream,
    EngineStats,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    InvalidRequestError,
    QueueFullError,
    SequenceDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
    heartbeat_health,
)
from app.serving.backends.local import LocalBackend, default_served_name, load_chat_template

if TYPE_CHECKING:
    from app.engine.async_engine import AsyncEngine, RequestStream
    from app.engine.outputs import RequestOutput
    from app.settings import Settings


# What a refusal about the prompt says (ours and the engine's); any other refusal of a request that carries a
# structured-output constraint is the constraint's (a schema, regex or grammar the compiler cannot take).
_PROMPT_WORDS = re.compile(r"\bprompt\b|context length|token id|request id", re.IGNORECASE)


def _param_of_refusal(request: GenerationRequest, message: str) -> str:
    if request.params.structured_outputs is not None and not _PROMPT_WORDS.search(message):
        return request.structured_param or "response_format"
    if request.params.best_of is not None and "best_of" in message:
        return "best_of"
    for field in ("interventions", "capture"):  # the engine names the field it refuses
        if message.startswith(field):
            return field
    if message.startswith("capture and interventions"):
        return "interventions"
    return "messages" if request.is_chat else "prompt"


class NativeBackend(LocalBackend):
    name = "native"
    supports_structured_outputs = True
    supports_hidden_states = True

    def __init__(
        self,
        *,
        model: str | None = None,
        served_model_name: str | None = None,
        max_waiting: int = 256,
        health_stall_seconds: float = 30.0,
        scheduling_policy: str = "fcfs",
        num_threads: int | None = None,
        speculative_config: Mapping[str, Any] | None = None,
        engine: AsyncEngine | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        super().__init__(served_model_name=default_served_name(model, served_model_name))
        self.chat_template = chat_template
        self.model_path = model
        self.max_waiting = max_waiting
        self.health_stall_seconds = health_stall_seconds
        self.scheduling_policy = scheduling_policy
        self.num_threads = num_threads
        self.speculative_config = dict(speculative_config) if speculative_config else None
        self.engine: AsyncEngine | None = engine
        self.engine_kwargs = dict(engine_kwargs or {})
        self._owns_engine = engine is None
        self._started = False

    @classmethod
    def from_settings(cls, settings: Settings) -> NativeBackend:
        return cls(
            model=settings.model,
            served_model_name=settings.served_model_name,
            max_waiting=settings.max_waiting,
            health_stall_seconds=settings.health_stall_seconds,
            scheduling_policy=settings.scheduling_policy,
            num_threads=settings.num_threads,
            speculative_config=settings.speculative_config,
            engine_kwargs={
                "kv_cache_eviction_policy": settings.kv_cache_eviction_policy,
                "prefix_cache_ttl_s": settings.prefix_cache_ttl_s,
                "batching_strategy": settings.batching_strategy,
                "batching_bucket_size": settings.batching_bucket_size,
                "dtype": settings.dtype,
                "kv_cache_dtype": settings.kv_cache_dtype,
                "quantization": settings.quantization,
                "enforce_eager": settings.enforce_eager,
                "framework": settings.framework,
                "max_model_len": settings.max_model_len,
                "max_num_seqs": settings.max_num_seqs,
                "max_num_batched_tokens": settings.max_num_batched_tokens,
                "block_size": settings.block_size,
                "enable_prefix_caching": settings.enable_prefix_caching,
                "seed": settings.seed,
            },
            chat_template=None if settings.chat_template is None else load_chat_template(settings.chat_template),
        )

    # ------------------------------------------------------------------------------------------ lifecycle
    def _build_engine(self) -> AsyncEngine:
        from app.engine.async_engine import AsyncEngine

        kwargs: dict[str, Any] = {
            "max_waiting": self.max_waiting,
            "scheduling_policy": self.scheduling_policy,
            "num_threads": self.num_threads,
            "speculative_config": self.speculative_config,
            **self.engine_kwargs,
        }
        return AsyncEngine(model=self.model_path, **kwargs)

    async def start(self) -> None:
        if self._started:
            return
        if self.engine is None:
            self.engine = await asyncio.to_thread(self._build_engine)
        await self.engine.start()
        core = self.engine.engine
        self.codec = core.tokenizer
        self.vocab_size = int(core.vocab_size)
        self.max_model_len = int(core.max_model_len)
        self.num_hidden_layers = int(core.model_config.num_layers)  # what /v1/embeddings' pooling captures
        self.hidden_size = int(core.model_config.hidden_size)
        self.scheduling_policy = core.config.scheduling_policy
        self._started = True

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self.engine is not None and self._owns_engine:
            await self.engine.shutdown()

    def _require_engine(self) -> AsyncEngine:
        if self.engine is None or not self._started:
            raise BackendUnavailableError("the native engine is not started")
        return self.engine

    async def health(self) -> HealthStatus:
        engine = self.engine
        if engine is None or not self._started:
            return HealthStatus(False, "the engine is not started")
        if engine.errored is not None:
            return HealthStatus(False, f"the engine loop failed: {engine.errored!r}")
        # Requests waiting and no step for the stall limit, counted from the last step or, when that was before
        # the work arrived (or never happened), from the moment the engine went from idle to busy: a step that
        # runs past the limit, a loop that never steps, or a first step that never comes.
        return heartbeat_health(
            alive=engine.is_running,
            has_work=engine.num_unfinished_requests > 0,
            last_step=engine.last_step_time,
            work_since=engine.busy_since,
            stall_seconds=self.health_stall_seconds,
            now=time.time(),  # the engine's times are wall-clock times
        )

    def stats(self) -> EngineStats | None:
        if self.engine is None or not self._started:
            return None
        s = self.engine.get_stats()
        return EngineStats(
            num_running=s.num_requests_running,
            num_waiting=s.num_requests_waiting,
            kv_cache_usage_perc=s.kv_cache_usage_perc,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            eviction_policy=s.eviction_policy,
            prefix_cache_evictions=s.prefix_cache_evictions,
            prefix_cache_expirations=s.prefix_cache_expirations,
            spec_decode_enabled=s.spec_decode_enabled,
            spec_decode_num_drafts=s.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(s.spec_decode_num_accepted_tokens_per_pos),
        )

    # ------------------------------------------------------------------------------------------ generation
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        from app.engine.async_engine import EngineDeadError, EngineQueueFullError

        engine = self._require_engine()
        if request.priority and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority is only honoured with priority scheduling: start the server with "
                "INF_ENGINE_SCHEDULING_POLICY=priority, or send priority 0",
                param="priority",
            )
        ids = self.prepare(request)
        try:
            stream = await engine.add_request(ids, request.params, request.request_id, request.priority)
        except EngineQueueFullError as exc:
            raise QueueFullError(f"the server is at capacity: {exc}; retry later") from None
        except EngineDeadError as exc:
            raise BackendUnavailableError(str(exc)) from None
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=_param_of_refusal(request, str(exc))) from None
        return ClosingStream(self._stream(request, len(ids), stream), stream.abort)

    async def _stream(
        self, request: GenerationRequest, num_prompt: int, stream: RequestStream
    ) -> AsyncIterator[GenerationChunk]:
        from app.engine.async_engine import EngineDeadError

        rid = request.request_id
        params = request.params
        top_k = params.logprobs
        seen_tokens = [0] * params.n
        seen_text = [0] * params.n
        first = True
        try:
            async for out in stream:
                chunk = GenerationChunk(rid, self._deltas(out, seen_tokens, seen_text, top_k), num_prompt)
                if first:
                    first = False
                    metrics = out.metrics
                    chunk.queue_time = metrics.queue_time if metrics is not None else None
                if out.finished:
                    chunk.finished = True
                    chunk.usage = Usage(num_prompt, sum(len(o.token_ids) for o in out.outputs))
                    chunk.hidden_states, chunk.hidden_positions = out.hidden_states, out.hidden_positions
                yield chunk
        except EngineDeadError as exc:
            raise BackendUnavailableError(str(exc)) from None
        finally:
            stream.abort()  # no-op once finished

    def _deltas(
        self, out: RequestOutput, seen_tokens: list[int], seen_text: list[int], top_k: int | None
    ) -> list[SequenceDelta]:
        deltas: list[SequenceDelta] = []
        for o in out.outputs:
            i = o.index
            new_ids = o.token_ids[seen_tokens[i] :]
            text = o.text[seen_text[i] :]
            logprobs = None
            if top_k is not None and o.logprobs is not None:
                logprobs = self._logprobs(new_ids, o.logprobs[seen_tokens[i] :], top_k)
            seen_tokens[i], seen_text[i] = len(o.token_ids), len(o.text)
            if new_ids or text or o.finish_reason:
                deltas.append(SequenceDelta(i, text, list(new_ids), logprobs, o.finish_reason, o.stop_reason))
        return deltas

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]], k: int) -> list[TokenLogprob]:
        """Each entry maps the sampled token and the top ``k`` alternatives to their log-probabilities (the
        sampled one is listed even when it is not among the best ``k``, and then ranks below them)."""
        out = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            top = tuple(TopLogprob(self.token_str(t), v, t) for t, v in ranked)
            out.append(
                TokenLogprob(self.token_str(token_id), entry.get(token_id, float("-inf")), token_id, top)
            )
        return out
