"""The Scheduler: runs the ready nodes of many ExecutionStates concurrently under one global limit.

One dispatcher serves every state submitted to it (a batch of items shares it), so ``max_concurrent`` and task
priorities hold across the whole batch. Dispatch is event driven: a finished task immediately starts the next
ready ones, with no polling. Cheap local nodes (inputs, ``F.*`` ops) run inline without taking a slot.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from app.pipeline.execution.node_runner import is_inline, resolve_args, run_llm_node, run_module_node
from app.pipeline.execution.state import ExecutionState, Task, TaskResult
from app.pipeline.graph import GraphNode, OpNode
from app.pipeline.resources.errors import RateLimitError, TransientError
from app.pipeline.values import Value, first_error_value

log = logging.getLogger(__name__)

#: a node rate-limited more often than this fails, so a permanently throttled endpoint cannot hang a run
MAX_RATE_LIMIT_REQUEUES = 100

CompleteHook = Callable[[str, TaskResult], Any]
FailedHook = Callable[[str, BaseException], Any]


@dataclass(eq=False)
class _Run:
    state: ExecutionState
    future: asyncio.Future[ExecutionState]
    on_complete: CompleteHook | None
    tag: str
    seq: int
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    timers: set[asyncio.TimerHandle] = field(default_factory=set)
    cancelled: bool = False


class Scheduler:
    def __init__(
        self,
        resource_manager: Any = None,
        max_concurrent: int = 100,
        task_timeout: float | None = None,
        max_task_retries: int | None = 0,
        task_retry_delay: float = 1.0,
        profiler: Any = None,
        on_task_complete: CompleteHook | None = None,
        on_task_failed: FailedHook | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.resource_manager = resource_manager
        self.max_concurrent = max_concurrent
        self.task_timeout = task_timeout
        self.max_task_retries = max_task_retries
        self.task_retry_delay = task_retry_delay
        self.profiler = profiler
        self.on_task_complete = on_task_complete
        self.on_task_failed = on_task_failed
        # ordered by task priority, then the run's submission order (finish started items first, so streams
        # yield early and memory stays flat), then task creation
        self._heap: list[tuple[int, int, Task, int, _Run]] = []
        self._order = itertools.count()
        self._running = 0
        self._alias_running: dict[str, int] = {}
        self._runs = itertools.count()
        self.max_running_observed = 0
        self._active_runs: dict[int, _Run] = {}
        self._reports_waits: bool | None = None
        if profiler is not None:
            profiler.set_global_capacity(max_concurrent)

    # -- public API -----------------------------------------------------------------------------------------
    async def execute(self, state: ExecutionState, on_complete: CompleteHook | None = None) -> Any:
        """Run ``state`` to the end and return its outputs (Values keyed like the forward's return)."""
        await self.submit(state, on_complete)
        return state.get_outputs()

    def submit(self, state: ExecutionState, on_complete: CompleteHook | None = None) -> asyncio.Future[Any]:
        """Start running ``state``; the future resolves to the state when nothing more can run."""
        loop = asyncio.get_running_loop()
        seq = next(self._runs)
        run = _Run(state, loop.create_future(), on_complete, state.execution_id or f"run{seq}", seq)
        if self.profiler is not None and self.resource_manager is not None:
            for alias in {n.alias for n in state.graph.nodes.values() if n.alias}:
                self.profiler.set_capacity(alias, _alias_capacity(self.resource_manager, alias))
        self._active_runs[id(run.future)] = run
        self._collect_ready(run)
        self._check_done(run)
        self._pump()
        return run.future

    def cancel(self, future_or_state: Any) -> None:
        """Cancel a submitted run: its queued tasks are dropped and its in-flight requests cancelled."""
        run = self._find_run(future_or_state)
        if run is None or run.cancelled:
            return
        run.cancelled = True
        for timer in run.timers:
            timer.cancel()
        for task in list(run.tasks):
            task.cancel()
        run.state.cancel_all()
        if not run.future.done():
            run.future.cancel()
        self._active_runs.pop(id(run.future), None)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._heap)

    # -- internals ------------------------------------------------------------------------------------------
    def _find_run(self, key: Any) -> _Run | None:
        if isinstance(key, ExecutionState):
            return next((r for r in self._active_runs.values() if r.state is key), None)
        return self._active_runs.get(id(key))

    def _collect_ready(self, run: _Run) -> None:
        """Move the state's ready tasks to the global heap; inline nodes run right away."""
        state = run.state
        while state.has_ready():
            for task in state.get_ready_tasks():
                node = state.graph.nodes[task.node_id]
                if is_inline(node):
                    self._run_inline(run, task, node)
                else:
                    self._push(run, task)

    def _push(self, run: _Run, task: Task) -> None:
        heapq.heappush(self._heap, (task.priority, run.seq, task, next(self._order), run))

    def _run_inline(self, run: _Run, task: Task, node: GraphNode) -> None:
        profiler = self.profiler
        task_id = f"{run.tag}:{node.id}"
        if profiler is not None:
            profiler.task_started(task_id, node.module_name or node.id, "local")
        start = time.perf_counter()
        args, kwargs = resolve_args(run.state, node)
        assert isinstance(node.module, OpNode)
        value = node.module.run(args, kwargs)
        self._complete(run, task, node, _stamp(value, node.id), start)

    def _pump(self) -> None:
        while self._heap and self._running < self.max_concurrent:
            _, _, task, _, run = heapq.heappop(self._heap)
            if run.cancelled:
                continue
            self._running += 1
            if self._running > self.max_running_observed:
                self.max_running_observed = self._running
            node = run.state.graph.nodes[task.node_id]
            alias = node.alias
            if alias is not None:
                self._alias_running[alias] = self._alias_running.get(alias, 0) + 1
            coro = self._run_task(run, task, node)
            atask = asyncio.get_running_loop().create_task(coro)
            run.tasks.add(atask)
            atask.add_done_callback(run.tasks.discard)
        if self.profiler is not None:
            self.profiler.queue_depth(len(self._heap), self._running)

    async def _run_task(self, run: _Run, task: Task, node: GraphNode) -> None:
        profiler = self.profiler
        task_id = f"{run.tag}:{node.id}"
        endpoint = node.alias or "local"
        if profiler is not None:
            args_for_profile = {"retry": task.retry_count} if task.retry_count else None
            profiler.task_started(task_id, node.module_name or node.id, endpoint, args_for_profile)
        start = time.perf_counter()
        released = False
        try:
            args, kwargs = resolve_args(run.state, node)
            failed_input = first_error_value(*args, **kwargs)
            if failed_input is not None:
                value = Value(failed_input.kind, failed_input.payload, node.id, dict(failed_input.meta))
            elif self.task_timeout is not None:
                async with asyncio.timeout(self.task_timeout):
                    value = await self._execute(node, args, kwargs, task_id)
            else:
                value = await self._execute(node, args, kwargs, task_id)
        except asyncio.CancelledError:
            if profiler is not None:
                profiler.task_failed(task_id, "cancelled")
            raise
        except RateLimitError as exc:
            self._release(node)
            released = True
            if profiler is not None:
                profiler.rate_limit_hit(endpoint, exc.retry_after)
                profiler.task_failed(task_id, f"rate limited: {exc}", will_retry=True)
            if task.rate_limit_count >= MAX_RATE_LIMIT_REQUEUES:
                self._fail(run, node, exc)
            else:
                # the resource manager already slowed the endpoint's limiter for every caller: requeue now
                new_task = run.state.requeue(node.id, rate_limited=True)
                self._requeue_task(run, new_task)
        except Exception as exc:
            error: BaseException = exc
            if isinstance(exc, TimeoutError):
                error = TransientError(f"{node.id} timed out after {self.task_timeout}s")
            self._release(node)
            released = True
            retries = self._retry_budget(node)
            retryable = isinstance(error, TransientError) and task.retry_count < retries
            if profiler is not None:
                profiler.task_failed(task_id, f"{type(error).__name__}: {error}", will_retry=retryable)
            if retryable:
                self._schedule_retry(run, task, node)
            else:
                self._fail(run, node, error)
        else:
            self._release(node)
            released = True
            self._complete(run, task, node, value, start)
        finally:
            if not released:
                self._release(node)
            self._pump()

    async def _execute(
        self, node: GraphNode, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str = ""
    ) -> Value:
        if node.kind == "llm":
            on_ready = None
            if self.profiler is not None and self._manager_reports_waits():
                # the time until the endpoint's slot and rate token are held shows as a wait in the trace
                profiler = self.profiler
                profiler.wait_started(task_id, node.alias or "local", "rate_limit")
                on_ready = partial(profiler.wait_finished, task_id)
            value = await run_llm_node(self.resource_manager, node, args, kwargs, on_ready)
        else:
            value = await run_module_node(node, args, kwargs)
        return _stamp(value, node.id)

    def _manager_reports_waits(self) -> bool:
        if self._reports_waits is None:
            complete = getattr(self.resource_manager, "complete", None)
            try:
                self._reports_waits = "on_ready" in inspect.signature(complete).parameters  # type: ignore[arg-type]
            except (TypeError, ValueError):
                self._reports_waits = False
        return self._reports_waits

    def _release(self, node: GraphNode) -> None:
        self._running -= 1
        alias = node.alias
        if alias is not None:
            self._alias_running[alias] -= 1

    def _retry_budget(self, node: GraphNode) -> int:
        if self.max_task_retries is not None:
            return self.max_task_retries
        if node.kind == "llm" and self.resource_manager is not None and node.alias is not None:
            try:
                return int(self.resource_manager.max_retries(node.alias))
            except Exception:
                return 0
        return 0

    def _schedule_retry(self, run: _Run, task: Task, node: GraphNode) -> None:
        delay = self.task_retry_delay * (2**task.retry_count)
        loop = asyncio.get_running_loop()

        def requeue() -> None:
            run.timers.discard(handle)
            if run.cancelled:
                return
            new_task = run.state.requeue(node.id, retry=True)
            self._requeue_task(run, new_task)
            self._pump()

        # the node stays "in progress" during the delay, so the run is not considered finished
        handle = loop.call_later(delay, requeue)
        run.timers.add(handle)

    def _requeue_task(self, run: _Run, task: Task) -> None:
        for ready in run.state.get_ready_tasks():
            self._push(run, ready)

    def _complete(self, run: _Run, task: Task, node: GraphNode, value: Value, start: float) -> None:
        result = TaskResult(node.id, value, (time.perf_counter() - start) * 1000.0, task.retry_count)
        run.state.mark_complete(node.id, result)
        if self.profiler is not None:
            self.profiler.task_finished(f"{run.tag}:{node.id}", {"kind": value.kind.value})
        for hook in (run.on_complete, self.on_task_complete):
            if hook is not None:
                _call_hook(hook, node.id, result)
        self._collect_ready(run)
        self._check_done(run)

    def _fail(self, run: _Run, node: GraphNode, error: BaseException) -> None:
        run.state.mark_failed(node.id, error)
        if self.on_task_failed is not None:
            _call_hook(self.on_task_failed, node.id, error)
        self._check_done(run)

    def _check_done(self, run: _Run) -> None:
        if run.state.is_complete() and not run.future.done():
            run.future.set_result(run.state)
            self._active_runs.pop(id(run.future), None)


def _stamp(value: Value, node_id: str) -> Value:
    """Results carry the id of the node that made them."""
    if value.ref == node_id:
        return value
    return Value(value.kind, value.payload, node_id, value.meta)


def _alias_capacity(manager: Any, alias: str) -> int | None:
    try:
        endpoints = manager.endpoints(alias)
    except Exception:
        return None
    caps: list[int | None] = [getattr(e, "max_concurrent", None) for e in endpoints]
    if not caps or any(c is None for c in caps):
        return None
    return sum(int(c or 0) for c in caps)


_hook_tasks: set[asyncio.Future[Any]] = set()


def _call_hook(hook: Callable[..., Any], *args: Any) -> None:
    try:
        result = hook(*args)
        if inspect.isawaitable(result):
            # keep a reference until done: the loop holds only weak references to tasks
            future = asyncio.ensure_future(result)
            _hook_tasks.add(future)
            future.add_done_callback(_hook_tasks.discard)
    except Exception:  # a user's callback must not break the run
        log.exception("execution callback %r failed", hook)

