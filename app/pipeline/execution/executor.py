"""Running modules: ``run()``, ``await module(x)``, batches and streams of BatchResults.

Every call resolves one RunConfig (call kwargs > bind > ExecutionSettings > defaults), traces each item into its
own graph, and submits all items to one Scheduler so the global concurrency limit and priorities span the batch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.pipeline.execution.checkpoint import CheckpointManager, input_fingerprint
from app.pipeline.execution.scheduler import Scheduler
from app.pipeline.execution.state import ExecutionState, TaskResult
from app.pipeline.graph import InferenceGraph
from app.pipeline.run_settings import (
    SETTING_NAMES,
    RunConfig,
    get_execution_settings,
    is_manager,
    make_manager,
)
from app.pipeline.tracing.tracer import Tracer
from app.pipeline.values import Value, ValueKind, unwrap


class ExecutionError(RuntimeError):
    """An item's pipeline could not produce its outputs; ``__cause__`` is the original error."""


@dataclass
class BatchResult:
    """One item of a streamed batch: ``output`` when it succeeded, ``error`` when it did not."""

    index: int
    input: Any
    output: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ForwardRecord:
    """What one forward pass did (graph and every node's value): what backward() walks."""

    graph: InferenceGraph
    node_values: dict[str, Value]
    module: Any
    inputs: Any = None
    outputs: Any = None
    execution_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


# -- configuration --------------------------------------------------------------------------------------------
def resolve_config(module: Any, call_kwargs: dict[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """Split call kwargs into settings and forward kwargs, then apply the precedence rules."""
    settings = {k: call_kwargs[k] for k in call_kwargs if k in SETTING_NAMES}
    forward_kwargs = {k: v for k, v in call_kwargs.items() if k not in SETTING_NAMES}
    context = get_execution_settings()
    config = context.run_config() if context is not None else RunConfig()
    if module is not None and getattr(module, "_bound_resources", None) is not None:
        config = config.updated({"resources": _bound_manager(module), **module._bound_settings})
    config = config.updated(settings)
    return config.validate(), forward_kwargs


def _bound_manager(module: Any) -> Any:
    """bind() resources become one ResourceManager per module, so its limits persist between calls."""
    resources = module._bound_resources
    if is_manager(resources):
        return resources
    cached = module.__dict__.get("_bound_manager")
    if cached is None or cached[0] is not resources:
        cached = (resources, _SharedManager(make_manager(resources)))
        object.__setattr__(module, "_bound_manager", cached)
    return cached[1]


class _SharedManager:
    """A bound module's manager: rate limits persist across calls; connections close when the last concurrent
    call ends (the manager reopens them on the next call)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.users = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    async def complete(self, alias: str, request: Any, on_ready: Callable[[], None] | None = None) -> Any:
        if on_ready is None:
            return await self.manager.complete(alias, request)
        return await self.manager.complete(alias, request, on_ready=on_ready)

    def acquire(self) -> None:
        self.users += 1

    async def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            await self.manager.aclose()


class _Session:
    """Everything one call shares across its items: resource manager, scheduler, profiler, checkpoints."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        resources = config.resources
        self.owns_manager = resources is not None and not is_manager(resources)
        self.manager = make_manager(resources) if self.owns_manager else resources
        if isinstance(self.manager, _SharedManager):
            self.manager.acquire()
        self.execution_id = config.execution_id or uuid.uuid4().hex
        self.profiler = config.profiler
        self.owns_profiler = False
        if self.profiler is None and config.profile:
            from app.pipeline.profiling.recording import TraceProfiler

            self.profiler = TraceProfiler(
                include_counters=config.profile_counters, include_args=config.profile_include_args
            )
            self.owns_profiler = True
        if self.profiler is not None:
            self.profiler.start()
        self.checkpoints = CheckpointManager(config.checkpoint_dir) if config.checkpoint_dir is not None else None
        self._resume: dict[str, dict[str, Value]] | None = None
        self.scheduler: Scheduler = config.scheduler or Scheduler(
            resource_manager=self.manager,
            max_concurrent=config.max_concurrent,
            task_timeout=config.task_timeout,
            max_task_retries=config.max_task_retries,
            task_retry_delay=config.task_retry_delay,
            profiler=self.profiler,
            on_task_complete=config.on_task_complete,
            on_task_failed=config.on_task_failed,
        )

    def prepare(self, module: Any, item_args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExecutionState:
        graph = Tracer().trace_values(module, *item_args, **kwargs)
        preloaded: dict[str, Value] = {}
        fingerprint = input_fingerprint([item_args, kwargs]) if self.checkpoints is not None else ""
        if self.checkpoints is not None:
            graph_hash = graph.compute_hash()
            if self._resume is None:
                self._resume = self._load_checkpoint(graph_hash)
            preloaded = self._resume.get(fingerprint, {})
        state = ExecutionState(graph, execution_id=f"{self.execution_id}:{fingerprint}" if fingerprint else None,
                               preloaded=preloaded)
        state.fingerprint = fingerprint  # type: ignore[attr-defined]
        return state

    def _load_checkpoint(self, graph_hash: str) -> dict[str, dict[str, Value]]:
        assert self.checkpoints is not None
        self.checkpoints.set_graph_hash(self.execution_id, graph_hash)
        checkpoint = self.checkpoints.load(self.execution_id)
        by_item: dict[str, dict[str, Value]] = {}
        if checkpoint is not None:
            for key, result in checkpoint.completed_nodes.items():
                fingerprint, _, node_id = key.partition("/")
                by_item.setdefault(fingerprint, {})[node_id] = result.value
        return by_item

    def submit(self, state: ExecutionState) -> asyncio.Future[Any]:
        hook = None
        if self.checkpoints is not None:
            checkpoints, execution_id, fingerprint = self.checkpoints, self.execution_id, state.fingerprint  # type: ignore[attr-defined]

            def hook(node_id: str, result: TaskResult) -> None:
                if checkpoints.record_completion(execution_id, f"{fingerprint}/{node_id}", result):
                    checkpoints.flush_sync(execution_id)

        return self.scheduler.submit(state, hook)

    async def close(self) -> None:
        if self.checkpoints is not None:
            await self.checkpoints.flush_all()
        if self.profiler is not None and self.owns_profiler:
            self.profiler.stop()
            path = self.config.profile_path or Path("traces") / f"{self.execution_id}.json"
            self.profiler.save(path)
        if self.owns_manager and self.manager is not None:
            await self.manager.aclose()
        elif isinstance(self.manager, _SharedManager):
            await self.manager.release()


def outputs_of(state: ExecutionState) -> Any:
    """The item's result as plain payloads (one output unwrapped), or raise its error."""
    error = state.first_error()
    if error is not None:
        raise error
    outputs = state.get_outputs()
    _raise_on_error_values(outputs)
    return unwrap(outputs)


def _raise_on_error_values(outputs: Any) -> None:
    if isinstance(outputs, Value):
        if outputs.kind is ValueKind.ERROR:
            exc = outputs.payload
            raise exc if isinstance(exc, BaseException) else ExecutionError(str(exc))
    elif outputs is None:
        raise ExecutionError("the pipeline was cancelled before producing its output")
    elif isinstance(outputs, dict):
        for v in outputs.values():
            _raise_on_error_values(v)
    elif isinstance(outputs, list | tuple):
        for v in outputs:
            _raise_on_error_values(v)


def _record_of(state: ExecutionState, module: Any, inputs: Any, outputs: Any, execution_id: str) -> ForwardRecord:
    values = {node_id: result.value for node_id, result in state.results.items()}
    return ForwardRecord(state.graph, values, module, inputs, outputs, execution_id)


# -- entry points ---------------------------------------------------------------------------------------------
async def run(
    module: Any,
    *args: Any,
    resources: Any = None,
    max_concurrent: int = 100,
    checkpoint_dir: str | Path | None = None,
    execution_id: str | None = None,
    record: bool = False,
    **kw: Any,
) -> Any:
    """Trace ``module`` on the inputs and run it. One output comes back unwrapped; several come back keyed like
    forward's return. ``record=True`` returns ``(output, ForwardRecord)``."""
    kw.update(
        resources=resources, max_concurrent=max_concurrent, checkpoint_dir=checkpoint_dir,
        execution_id=execution_id,
    )
    config, forward_kwargs = resolve_config(None, {k: v for k, v in kw.items() if v is not None})
    if "max_concurrent" not in kw or kw["max_concurrent"] is None:
        config.max_concurrent = max_concurrent
    session = _Session(config)
    try:
        state = session.prepare(module, args, forward_kwargs)
        await session.submit(state)
        output = outputs_of(state)
        if record:
            return output, _record_of(state, module, args, output, session.execution_id)
        return output
    finally:
        await session.close()


def call_module(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``module(...)`` returns when resources are available: a coroutine, or an async iterator of
    BatchResults for a streamed batch (a list as the first argument is a batch)."""
    config, forward_kwargs = resolve_config(module, kwargs)
    if args and isinstance(args[0], list):
        items = [((item, *args[1:]), forward_kwargs) for item in args[0]]
        if config.streaming:
            return stream_batch(module, items, config)
        return run_batch(module, items, config)
    return _run_one(module, args, forward_kwargs, config)


async def _run_one(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: RunConfig) -> Any:
    session = _Session(config)
    try:
        state = session.prepare(module, args, kwargs)
        await session.submit(state)
        output = outputs_of(state)
        if config.record or getattr(module, "training", False):
            return _attach_record(output, _record_of(state, module, args, output, session.execution_id))
        return output
    finally:
        await session.close()


def _attach_record(output: Any, record: ForwardRecord) -> Any:
    from app.pipeline.record import TracedOutput

    return TracedOutput(output, record)


#: one batch item: positional and keyword arguments of forward
Item = tuple[tuple[Any, ...], dict[str, Any]]


async def _completed_items(
    session: _Session, module: Any, items: list[Item]
) -> AsyncGenerator[tuple[int, ExecutionState], None]:
    """Trace and submit items in chunks (so the first requests start before the last item is traced) and
    yield ``(index, state)`` as items finish. Closing the iterator cancels what is still running."""
    queue: asyncio.Queue[tuple[int, asyncio.Future[Any]]] = asyncio.Queue()
    futures: list[asyncio.Future[Any]] = []
    chunk = max(16, min(session.config.max_concurrent, 256))

    async def submit_all() -> None:
        for start in range(0, len(items), chunk):
            for index in range(start, min(start + chunk, len(items))):
                future = session.submit(session.prepare(module, *items[index]))
                future.add_done_callback(_enqueue_done(queue, index))
                futures.append(future)
            await asyncio.sleep(0)  # let the dispatched requests go out while the next chunk is traced

    submitter = asyncio.get_running_loop().create_task(submit_all())
    try:
        for _ in range(len(items)):
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, submitter} if not submitter.done() else {getter},
                               return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                submitter.result()  # tracing failed: raise its error
                index, future = await queue.get()
            else:
                index, future = getter.result()
            if future.cancelled():
                continue
            yield index, future.result()
        submitter.result()
    finally:
        submitter.cancel()
        for future in futures:
            if not future.done():
                session.scheduler.cancel(future)


def _enqueue_done(queue: asyncio.Queue[tuple[int, asyncio.Future[Any]]], index: int) -> Callable[[Any], None]:
    return lambda future: queue.put_nowait((index, future))


async def run_batch(module: Any, items: list[Item], config: RunConfig) -> list[Any]:
    """Run every item concurrently; results in input order. The first failure cancels the rest and raises."""
    session = _Session(config)
    wants_record = config.record or getattr(module, "training", False)
    outputs: list[Any] = [None] * len(items)
    try:
        done = 0
        completed = _completed_items(session, module, items)
        try:
            async for index, state in completed:
                output = outputs_of(state)  # raises the item's error
                if wants_record:
                    output = _attach_record(output, _record_of(state, module, _item_input(items[index]), output,
                                                               session.execution_id))
                outputs[index] = output
                done += 1
                if config.on_progress is not None:
                    config.on_progress(done, len(items))
        finally:
            await completed.aclose()
        return outputs
    finally:
        await session.close()


async def stream_batch(module: Any, items: list[Item], config: RunConfig) -> AsyncIterator[BatchResult]:
    """Yield one BatchResult per item as it finishes (input order with ``preserve_order``). One item's failure
    stays in its BatchResult. Leaving the loop early cancels the remaining items and their requests."""
    session = _Session(config)
    try:
        done, next_index = 0, 0
        held: dict[int, BatchResult] = {}
        completed = _completed_items(session, module, items)
        try:
            async for index, state in completed:
                result = _batch_result(index, items[index], state, module, session)
                done += 1
                if config.on_progress is not None:
                    config.on_progress(done, len(items))
                if not config.preserve_order:
                    yield result
                    continue
                held[index] = result
                while next_index in held:
                    yield held.pop(next_index)
                    next_index += 1
        finally:
            await completed.aclose()
    finally:
        await session.close()


def _item_input(item: Item) -> Any:
    args, kwargs = item
    if kwargs and not args:
        return kwargs
    return args[0] if len(args) == 1 else args


def _batch_result(index: int, item: Item, state: ExecutionState, module: Any, session: _Session) -> BatchResult:
    value = _item_input(item)
    try:
        output = outputs_of(state)
    except Exception as exc:
        return BatchResult(index, value, None, exc)
    if getattr(module, "training", False) or session.config.record:
        output = _attach_record(output, _record_of(state, module, value, output, session.execution_id))
    return BatchResult(index, value, output, None)


def now_ms() -> float:
    return time.perf_counter() * 1000.0


def run_items(module: Any, items: list[Item], **settings: Any) -> AsyncIterator[BatchResult]:
    """Stream a batch whose items each carry their own ``(args, kwargs)`` (what the CLI and jobs use)."""
    config, _ = resolve_config(module, {**settings, "streaming": True})
    return stream_batch(module, items, config)
