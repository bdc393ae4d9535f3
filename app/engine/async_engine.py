"""``AsyncEngine``: an ``LLMEngine`` behind an asyncio interface, for servers and workers.

One background task owns the engine. It applies queued commands (add, abort) between steps and runs each
blocking ``step()`` on a dedicated worker thread, so the event loop stays responsive and exactly one
thread touches the engine at a time. Every concurrent ``generate()`` call lands in the same scheduler,
so continuous batching serves them together.

Streams end with a ``finished`` output. A consumer that stops iterating or is cancelled aborts its request
(its KV blocks are freed) when its generator is closed; use ``contextlib.aclosing`` to make that immediate.

A request with ``structured_outputs`` has its grammar compiled on a worker thread (``asyncio.to_thread``)
before it is queued, so a slow compile (up to ~0.75 s for a large schema) never holds up the step loop or the
other requests' tokens; xgrammar drops the GIL while compiling. The engine then finds the grammar in its
cache when it adds the request. A request with ``best_of > n`` yields only its final output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app.aio import wait_event
from app.engine.core.sampling_params import SamplingParams
from app.engine.llm_engine import EngineQueueFullError, LLMEngine, PromptInput
from app.engine.metrics import EngineStats
from app.engine.outputs import RequestOutput

__all__ = ["AsyncEngine", "EngineDeadError", "EngineQueueFullError", "RequestStream"]

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed (see ``__cause__`` / ``AsyncEngine.errored``) or was shut down."""


_END = object()  # stream sentinel: no more outputs (the request was dropped without a final output)


@dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams | None
    priority: int
    arrival_time: float
    done: asyncio.Future[None]


@dataclass
class RequestStream:
    """The outputs of one request, in order; iterate with ``async for``."""

    request_id: str
    _engine: AsyncEngine
    _queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item  # type: ignore[no-any-return]

    def abort(self) -> None:
        """Abort the request unless it already finished (safe to call from ``finally`` blocks)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """``AsyncEngine(engine)`` wraps an existing ``LLMEngine``; ``AsyncEngine(**kwargs)`` builds one
    (blocking: it loads the model). Start it with ``await start()`` (``generate`` also starts it)."""

    def __init__(
        self, engine: LLMEngine | None = None, *, heartbeat_interval_s: float = 1.0, **engine_kwargs: Any
    ) -> None:
        if engine is not None and engine_kwargs:
            raise ValueError("pass an engine or engine options, not both")
        self.engine = engine if engine is not None else LLMEngine(**engine_kwargs)
        self.heartbeat_interval_s = heartbeat_interval_s
        self._commands: deque[_Add | str] = deque()  # _Add, or a request id to abort
        self._streams: dict[str, RequestStream] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._pending_adds = 0
        self._ids = itertools.count()
        self.errored: BaseException | None = None
        self.last_step_time: float | None = None  # time.time() of the last completed step
        self.last_heartbeat: float | None = None  # time.time() of the loop's last sign of life, idle or not
        self.busy_since: float | None = (
            None  # time.time() the engine last went from no request to one (health)
        )
        self.num_steps = 0

    @classmethod
    async def create(cls, *, heartbeat_interval_s: float = 1.0, **engine_kwargs: Any) -> AsyncEngine:
        """Load the model on a worker thread (the event loop keeps serving meanwhile), then start."""
        engine = await asyncio.to_thread(LLMEngine, **engine_kwargs)
        self = cls(engine, heartbeat_interval_s=heartbeat_interval_s)
        await self.start()
        return self

    # ---- lifecycle ----
    @property
    def is_running(self) -> bool:
        return (
            self._task is not None and not self._task.done() and self.errored is None and not self._stopping
        )

    async def start(self) -> None:
        if self.is_running:
            return
        if self.errored is not None:
            raise EngineDeadError("the engine loop failed earlier; build a new AsyncEngine") from self.errored
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._stopping = False
        # One dedicated thread: torch's per-thread state stays put, and steps can never overlap.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self.last_heartbeat = time.time()
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def shutdown(self) -> None:
        """Stop the loop after the step in flight; unfinished requests are aborted and their streams end
        with EngineDeadError."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request_id in self.engine.unfinished_request_ids():
            self.engine.abort_request(request_id)
        self._fail_all(EngineDeadError("the engine was shut down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- requests ----
    async def add_request(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request and return its output stream. Invalid input raises ValueError here (before
        any output); a full waiting queue raises :class:`EngineQueueFullError` at once."""
        if not self.is_running:
            if self.errored is not None:
                raise EngineDeadError("the engine loop failed") from self.errored
            await self.start()
        if request_id is None:
            request_id = f"async-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        spec = sampling_params.structured_outputs if sampling_params is not None else None
        if spec is not None:
            # Off the loop thread and off the step thread: other requests keep stepping meanwhile. Errors
            # (an invalid or too large spec) are the caller's ValueError, before anything is queued.
            await asyncio.to_thread(self.engine.guided.compile, spec)
        # No await from here until the request is queued: the checks below still hold when it is.
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_waiting = self.engine.config.max_waiting
        # Shed load without waiting for the step in flight (len() of the queue is safe to read).
        if max_waiting is not None and len(self.engine.scheduler.waiting) + self._pending_adds >= max_waiting:
            raise EngineQueueFullError(f"the waiting queue is full ({max_waiting} requests)")
        assert self._loop is not None and self._wakeup is not None
        done: asyncio.Future[None] = self._loop.create_future()
        stream = RequestStream(request_id, self)
        if not self._streams:
            self.busy_since = time.time()
        self._streams[request_id] = stream
        self._commands.append(_Add(request_id, prompt, sampling_params, priority, time.monotonic(), done))
        self._pending_adds += 1
        self._wakeup.set()
        try:
            await done  # raises the engine's ValueError / EngineQueueFullError
        except BaseException:
            self._streams.pop(request_id, None)
            if not done.done():  # cancelled while queued: make sure it never runs
                done.cancel()
            elif not done.cancelled() and done.exception() is None:
                self.abort(request_id)  # added, but our caller was cancelled at that very moment
            raise
        return stream

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (cumulative text; the last one has ``finished=True``). Leaving the
        loop early or being cancelled aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished). Does not wait: the engine applies it between
        steps, and the request's stream then ends with a final output whose finish_reason is "abort"."""
        self._commands.append(request_id)
        if self._wakeup is not None and self._loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                self._wakeup.set()
            else:  # e.g. an async generator finalised from another thread
                self._loop.call_soon_threadsafe(self._wakeup.set)

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ---- the loop ----
    def _apply_commands(self) -> None:
        engine = self.engine
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, str):
                output = engine.abort_request(cmd)
                stream = self._streams.pop(cmd, None)
                if stream is not None:
                    stream._queue.put_nowait(output if output is not None else _END)
                continue
            self._pending_adds -= 1
            if cmd.done.done():  # cancelled by its caller while queued
                continue
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority, cmd.arrival_time)
            except Exception as exc:  # ValueError, EngineQueueFullError: the caller's problem, not ours
                self._streams.pop(cmd.request_id, None)
                cmd.done.set_exception(exc)
            else:
                cmd.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._queue.put_nowait(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Add):
                self._pending_adds -= 1
                if not cmd.done.done():
                    cmd.done.set_exception(exc)
        for stream in self._streams.values():
            stream._queue.put_nowait(exc)
        self._streams.clear()

    async def _run(self) -> None:
        assert self._wakeup is not None and self._executor is not None
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while not self._stopping:
                self.last_heartbeat = time.time()
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if self._commands:
                        continue
                    await wait_event(self._wakeup, self.heartbeat_interval_s)
                    continue
                outputs = await loop.run_in_executor(self._executor, engine.step)
                self.num_steps += 1
                self.last_step_time = self.last_heartbeat = time.time()
                self._deliver(outputs)
                await asyncio.sleep(0)  # let consumers and new callers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine loop failed")
            self.errored = exc
            dead = EngineDeadError(f"the engine loop failed: {exc!r}")
            dead.__cause__ = exc
            self._fail_all(dead)
