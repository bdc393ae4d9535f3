"""What ``inf-engine worker --engine`` adds to a worker process: one engine, fed by many tasks at once.

An engine worker runs Celery's thread pool: N task threads in one process. Each task hands its coroutine to the
process's one event loop (:class:`LoopHost`, on a daemon thread), so the requests of all running tasks meet in
one ``AsyncEngine`` and continuous batching decodes them together; a task costs a batch slot, not a model copy.
Native endpoints without a ``base_url`` resolve to the in-process engine of ``app.serving.embedded``, whose
weights load once per process on first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from app.jobs.distributed.stages import clock as stage_clock
from app.settings import Settings

T = TypeVar("T")


class LoopHost:
    """One asyncio event loop on a daemon thread, shared by every task thread of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                ready = threading.Event()
                loop = asyncio.new_event_loop()

                def serve() -> None:
                    stage_clock.name_thread("loop")  # its CPU time is the calls' share of a node's cost
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=serve, name="engine-host-loop", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the shared loop; the caller (a task thread) waits on the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the shared loop and wait for it from this (task) thread; cancelled on timeout."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the engine host's coroutine did not finish within {timeout} s") from None

    def stop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(timeout=10)
            loop.close()


def setup_engine_worker(settings: Settings) -> None:
    """Route native endpoints without a URL to this process's own engine (loaded on first use)."""
    from app.serving.embedded import register_embedded_engine

    options: dict[str, Any] = {}
    if settings.num_threads is not None:
        options["num_threads"] = settings.num_threads
    register_embedded_engine(**options)
