"""The baseline: Hugging Face ``generate`` on one worker thread, one request at a time, streamed.

Each request runs ``model.generate`` with a streamer that, on the worker thread, pairs every new token with
its raw log-probability (recorded by a logits processor before penalties), detokenizes incrementally, watches
for stop strings, and hands the increments to the event loop. Requests queue in front of the single worker;
at most ``max_waiting`` may wait, the next one is refused with :class:`QueueFullError`. Closing a stream sets
a flag that a stopping criterion checks every step, so an abandoned request stops within one token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from app.engine.core.sampling_params import SamplingParams
from app.engine.tokenizer import IncrementalDetokenizer
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
from app.serving.backends.local import (
    LocalBackend,
    StopStringMatcher,
    default_served_name,
    load_chat_template,
    resolve_hf_folder,
)

if TYPE_CHECKING:
    import torch

    from app.settings import Settings

_DONE = object()


class _HFCodec:
    """A transformers tokenizer seen through the TextCodec protocol."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # transformers' fast tokenizers reconfigure truncation/padding on their Rust object per call, which
        # fails ("Already borrowed") when two threads (requests, the generation thread) use it at once.
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        if not kw.get("chat_template") and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        with self._lock:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
            )
        return str(text)


def _check_supported(request: GenerationRequest) -> None:
    p = request.params
    if p.structured_outputs is not None:
        raise InvalidRequestError(
            "structured outputs (response_format, structured_outputs, guided_*, forced tool calls) need the "
            "native or vllm backend; this server runs the transformers baseline",
            param=request.structured_param or "response_format",
        )
    if p.best_of is not None and p.best_of > p.n:
        raise InvalidRequestError(
            "best_of greater than n needs the native or vllm backend; this server runs the transformers baseline",
            param="best_of",
        )


class TransformersBackend(LocalBackend):
    name = "transformers"

    def __init__(
        self,
        *,
        model: str | None = None,
        served_model_name: str | None = None,
        max_waiting: int = 256,
        health_stall_seconds: float = 30.0,
        device: str = "cpu",
        num_threads: int | None = None,
        chat_template: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(served_model_name=default_served_name(model, served_model_name))
        self.chat_template = chat_template
        self.seed = seed
        self.model_path = model
        self.max_waiting = max_waiting
        self.health_stall_seconds = health_stall_seconds
        self.device = device
        self.num_threads = num_threads
        self.hf_model: Any = None
        self.eos_token_ids: tuple[int, ...] = ()
        self._executor: ThreadPoolExecutor | None = None
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._last_step: float | None = None  # time.monotonic() of the last token or request start
        self._busy_since: float | None = None  # time.monotonic() when the backend last went from idle to busy

    @classmethod
    def from_settings(cls, settings: Settings) -> TransformersBackend:
        return cls(
            model=settings.model,
            served_model_name=settings.served_model_name,
            max_waiting=settings.max_waiting,
            health_stall_seconds=settings.health_stall_seconds,
            num_threads=settings.num_threads,
            chat_template=None if settings.chat_template is None else load_chat_template(settings.chat_template),
            seed=settings.seed,
        )

    # ------------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.hf_model is not None:
            return
        await asyncio.to_thread(self._load)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        folder = resolve_hf_folder(self.model_path)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        model = model.to(self.device).eval()
        eos: list[int] = []
        for source in (
            model.generation_config.eos_token_id,
            model.config.eos_token_id,
            tokenizer.eos_token_id,
        ):
            for token_id in source if isinstance(source, list | tuple) else [source]:
                if isinstance(token_id, int) and token_id not in eos:
                    eos.append(token_id)
        self.eos_token_ids = tuple(eos)
        # We stop on eos / stop ids ourselves (ignore_eos, min_tokens, stop_token_ids): generate() must not,
        # and it fills unset options from the model's generation_config, so clear it there.
        model.generation_config.eos_token_id = None
        self.codec = _HFCodec(tokenizer)
        self.vocab_size = int(model.config.vocab_size)
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.hf_model = model

    async def stop(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)

    async def health(self) -> HealthStatus:
        with self._count_lock:
            has_work = bool(self._running or self._waiting)
        return heartbeat_health(
            alive=self._executor is not None,
            has_work=has_work,
            last_step=self._last_step,
            work_since=self._busy_since,
            stall_seconds=self.health_stall_seconds,
        )

    def stats(self) -> EngineStats:
        with self._count_lock:
            return EngineStats(num_running=self._running, num_waiting=self._waiting)

    # ------------------------------------------------------------------------------------------ generation
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        executor = self._executor
        if executor is None or self.hf_model is None:
            raise BackendUnavailableError("the transformers backend is not started")
        _check_supported(request)
        ids = await asyncio.to_thread(self.prepare, request)
        with self._count_lock:
            if self._waiting >= self.max_waiting:
                raise QueueFullError(
                    f"the server is at capacity: {self._waiting} requests are waiting; retry later"
                )
            if not (self._waiting or self._running):
                self._busy_since = time.monotonic()
            self._waiting += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody listens any more
                cancel.set()

        try:
            future = loop.run_in_executor(executor, self._run_request, ids, request, emit, cancel)
        except RuntimeError:  # shut down meanwhile
            with self._count_lock:
                self._waiting -= 1
            raise BackendUnavailableError("the transformers backend is shutting down") from None
        future.add_done_callback(
            lambda f: f.cancelled() or f.exception()
        )  # never "exception never retrieved"
        # Closing the stream (even unread) sets ``cancel``: a queued job then returns at once, a running one
        # stops at its next token.
        return ClosingStream(self._stream(queue, cancel), cancel.set)

    @staticmethod
    async def _stream(queue: asyncio.Queue[Any], cancel: threading.Event) -> AsyncIterator[GenerationChunk]:
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()

    def _run_request(
        self, ids: list[int], request: GenerationRequest, emit: Callable[[Any], None], cancel: threading.Event
    ) -> None:
        """On the worker thread: all ``n`` samples of one request, one after the other."""
        with self._count_lock:
            self._waiting -= 1
            self._running += 1
        self._last_step = time.monotonic()
        try:
            if cancel.is_set():
                return
            queue_time = time.monotonic() - request.arrival_time
            emit(GenerationChunk(request.request_id, [], num_prompt_tokens=len(ids), queue_time=queue_time))
            params = request.params
            seed = params.seed if params.seed is not None else self.seed
            if seed is not None:  # the server's --seed for requests without one, as vLLM's
                import torch

                torch.manual_seed(seed)
            total = 0
            for index in range(params.n):
                if cancel.is_set():
                    return
                total += self._run_sample(ids, params, index, request.request_id, emit, cancel)
            emit(
                GenerationChunk(
                    request.request_id,
                    [],
                    num_prompt_tokens=len(ids),
                    finished=True,
                    usage=Usage(prompt_tokens=len(ids), completion_tokens=total),
                )
            )
        except Exception as exc:
            emit(BackendUnavailableError(f"generation failed in the transformers backend: {exc}"))
        finally:
            with self._count_lock:
                self._running -= 1
            emit(_DONE)

    def _run_sample(
        self,
        ids: list[int],
        params: SamplingParams,
        index: int,
        request_id: str,
        emit: Callable[[Any], None],
        cancel: threading.Event,
    ) -> int:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        stop_ids = set(params.stop_token_ids or ())
        eos_ids = set() if params.ignore_eos else set(self.eos_token_ids)
        end_ids = sorted(stop_ids | eos_ids)
        limit = (self.max_model_len or len(ids) + (1 << 20)) - len(ids)
        max_new = limit if params.max_tokens is None else min(params.max_tokens, limit)
        recorder = _LogprobRecorder() if params.logprobs is not None else None
        processors: list[Any] = [] if recorder is None else [recorder]
        processors.append(_Penalties(params, len(ids), sorted(stop_ids | set(self.eos_token_ids))))
        streamer = _Streamer(self, ids, params, index, request_id, emit, cancel, recorder, set(end_ids))
        sampling: dict[str, Any] = {"do_sample": False}
        if not params.is_greedy:
            top_k = params.top_k if params.top_k and params.top_k > 0 else 0
            sampling = {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": top_k,
                "min_p": params.min_p or None,
            }
        config = GenerationConfig(
            max_new_tokens=max_new,
            pad_token_id=(self.eos_token_ids or (0,))[0],
            **sampling,
        )
        with torch.inference_mode():
            self.hf_model.generate(
                torch.tensor([ids], device=self.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([_Cancelled(cancel, streamer)]),
                streamer=streamer,
            )
        streamer.finish()
        return streamer.count


class _LogprobRecorder:
    """First logits processor: keeps the raw log-softmax of the step (vLLM's default ``raw_logprobs``)."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = torch_log_softmax(scores[0])
        return scores


def torch_log_softmax(row: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.log_softmax(row.float(), dim=-1)


class _Penalties:
    """vLLM's penalties on top of HF: repetition (prompt and output), presence and frequency (output only),
    logit_bias, and min_tokens (stop and eos ids masked until enough tokens exist)."""

    def __init__(self, params: SamplingParams, prompt_len: int, end_ids: list[int]) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self.end_ids = end_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        p = self.params
        out = input_ids[0, self.prompt_len :]
        if p.repetition_penalty != 1.0:
            seen = torch.unique(input_ids[0])
            vals = scores[0, seen]
            scores[0, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and out.numel():
            counts = torch.bincount(out, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
            scores[0] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < scores.shape[-1]:
                scores[0, token_id] += bias
        if out.numel() < p.min_tokens and self.end_ids:
            scores[0, self.end_ids] = -float("inf")
        return scores


class _Cancelled:
    def __init__(self, cancel: threading.Event, streamer: _Streamer) -> None:
        self.cancel = cancel
        self.streamer = streamer

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        import torch

        stop = self.cancel.is_set() or self.streamer.finish_reason is not None
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _Streamer:
    """Receives each new token on the worker thread and emits a :class:`GenerationChunk` for it."""

    def __init__(
        self,
        backend: TransformersBackend,
        prompt_ids: list[int],
        params: SamplingParams,
        index: int,
        request_id: str,
        emit: Callable[[Any], None],
        cancel: threading.Event,
        recorder: _LogprobRecorder | None,
        end_ids: set[int],
    ) -> None:
        self.backend = backend
        self.params = params
        self.index = index
        self.request_id = request_id
        self.emit = emit
        self.cancel = cancel
        self.recorder = recorder
        self.end_ids = end_ids
        self.detok = IncrementalDetokenizer(
            backend.codec, prompt_ids=prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.matcher = StopStringMatcher(params.stop_strings, params.include_stop_str_in_output)
        self.count = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._skipped_prompt = False
        self._done = False

    def put(self, value: Any) -> None:
        if not self._skipped_prompt:  # generate() first puts the prompt itself
            self._skipped_prompt = True
            return
        if self.finish_reason is not None or self.cancel.is_set():
            return
        token_id = int(value.reshape(-1)[0])
        self.count += 1
        self.backend._last_step = time.monotonic()
        logprobs = None if self.recorder is None else [self._logprob(token_id)]
        if token_id in self.end_ids:  # min_tokens is enforced by masking these ids in _Penalties
            self.finish_reason = "stop"
            self.stop_reason = None if token_id in self.backend.eos_token_ids else token_id
            text = self.matcher.feed(self.detok.add(token_id)) + self.matcher.flush()
        else:
            text = self.matcher.feed(self.detok.add(token_id))
            if self.matcher.stopped is not None:
                self.finish_reason, self.stop_reason = "stop", self.matcher.stopped
            elif self.params.max_tokens is not None and self.count >= self.params.max_tokens:
                text += self.matcher.feed(self.detok.flush()) + self.matcher.flush()
                self.finish_reason = "length"
        delta = SequenceDelta(
            self.index,
            text=text,
            token_ids=[token_id],
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.emit(GenerationChunk(self.request_id, [delta]))
        if self.finish_reason is not None:
            self._done = True

    def _logprob(self, token_id: int) -> TokenLogprob:
        import torch

        assert self.recorder is not None and self.recorder.last is not None
        row = self.recorder.last
        top: tuple[TopLogprob, ...] = ()
        k = self.params.logprobs or 0
        if k > 0:
            vals, idx = torch.topk(row, min(k, row.shape[-1]))
            top = tuple(
                TopLogprob(self.backend.token_str(int(i)), float(v), int(i))
                for v, i in zip(vals.tolist(), idx.tolist(), strict=True)
            )
        return TokenLogprob(self.backend.token_str(token_id), float(row[token_id]), token_id, top)

    def end(self) -> None:
        pass

    def finish(self) -> None:
        """After generate returns: close the sample if no token did (length limit of the context, cancel)."""
        if self._done:
            return
        self._done = True
        if self.cancel.is_set():
            return
        text = self.matcher.feed(self.detok.flush()) + self.matcher.flush()
        self.finish_reason = self.finish_reason or "length"
        self.emit(
            GenerationChunk(
                self.request_id, [SequenceDelta(self.index, text=text, finish_reason=self.finish_reason)]
            )
        )
