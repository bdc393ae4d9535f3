"""The synchronous client is the asynchronous one run on an event loop in a thread of its own.

Each synchronous resource names the asynchronous methods it offers (``get = sync_method(AsyncJobs.get)``): the
signature, the docstring and the types come from the one definition, and a call blocks until its coroutine has
run on the loop. A separate loop thread (rather than ``asyncio.run`` per call) keeps the connection pool alive
between calls and works where the caller already runs an event loop (a notebook)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


class LoopThread:
    """An event loop on a daemon thread, started at the first call and stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="inf-engine-client", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result (its exception is raised here)."""
        if self._thread is not None and threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("the synchronous client was called from its own event loop: use AsyncClient there")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._running_loop())
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the request stops too
            raise

    def stop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()


class SyncResource(Generic[R]):
    """A group of synchronous methods over the asynchronous resource ``R``."""

    def __init__(self, runner: LoopThread, resource: R) -> None:
        self._runner = runner
        self._async = resource


class SyncStream(Iterator[T]):
    """An asynchronous iterator read synchronously. Close it (or use ``with``) to stop early: that closes the
    HTTP stream behind it."""

    def __init__(self, runner: LoopThread, source: AsyncIterator[T]) -> None:
        self._runner = runner
        self._source = source
        self._closed = False

    def __iter__(self) -> SyncStream[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        try:
            return self._runner.run(_next(self._source))
        except StopAsyncIteration:
            self._closed = True
            raise StopIteration from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                self._runner.run(aclose())

    def __enter__(self) -> SyncStream[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


async def _next(source: AsyncIterator[T]) -> T:
    return await source.__anext__()


class sync_method(Generic[P, T]):  # lower case: it is used like a decorator
    """A synchronous method that runs the asynchronous method ``method`` of the resource's ``_async``."""

    def __init__(self, method: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]) -> None:
        self._method = method
        self._signature = _without_self(method)

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> sync_method[P, T]: ...
    @overload
    def __get__(self, obj: SyncResource[Any], owner: type | None = None) -> Callable[P, T]: ...
    def __get__(self, obj: SyncResource[Any] | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        method, runner, target = self._method, obj._runner, obj._async

        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return runner.run(method(target, *args, **kwargs))

        call.__signature__ = self._signature  # type: ignore[attr-defined]
        return call


class sync_stream(Generic[P, T]):  # lower case: it is used like a decorator
    """A synchronous method that reads the asynchronous iterator ``method`` returns, as a :class:`SyncStream`."""

    def __init__(self, method: Callable[Concatenate[Any, P], AsyncIterator[T]]) -> None:
        self._method = method
        self._signature = _without_self(method)

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> sync_stream[P, T]: ...
    @overload
    def __get__(self, obj: SyncResource[Any], owner: type | None = None) -> Callable[P, SyncStream[T]]: ...
    def __get__(self, obj: SyncResource[Any] | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        method, runner, target = self._method, obj._runner, obj._async

        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> SyncStream[T]:
            return SyncStream(runner, method(target, *args, **kwargs))

        call.__signature__ = self._signature  # type: ignore[attr-defined]
        return call


def _without_self(method: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(method)
    return signature.replace(parameters=list(signature.parameters.values())[1:])
