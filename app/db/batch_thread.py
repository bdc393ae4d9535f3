"""The queue both group commits share (:class:`app.db.group_commit.GroupCommit` on PostgreSQL,
:class:`app.db.sqlite_writer.SqliteWriter` on SQLite): callers queue an entry and wait on it; one thread takes
everything queued (up to ``max_batch``), runs it and wakes those callers. The thread starts with the first entry
and stops after ``idle_s`` without any (the next entry starts another), or at :meth:`BatchThread.close`, which
runs what is queued first. How a batch runs is the subclass's ``_loop``."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Generic, Protocol, TypeVar

__all__ = ["BatchThread", "held_lock"]


class Entry(Protocol):
    done: threading.Lock  # held until the thread is done with the entry
    error: BaseException | None


E = TypeVar("E", bound=Entry)


def held_lock() -> threading.Lock:
    """A lock already held: a caller waits on it until the thread releases it (a bare lock is cheaper to create,
    wait on and release than an Event, per entry)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class BatchThread(ABC, Generic[E]):
    thread_name = "batch"
    closed_message = "closed"

    def __init__(self, *, max_batch: int, idle_s: float) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if idle_s < 0:
            raise ValueError("idle_s must not be negative")
        self._max_batch = max_batch
        self._idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: deque[E] = deque()
        self._thread: threading.Thread | None = None  # running, or None: the next entry starts one
        self._last: threading.Thread | None = None  # joined by close() even if it stopped idle meanwhile
        self._closed = False

    @property
    def queued(self) -> int:
        """Entries waiting for the next batch (not those of the batch in flight)."""
        with self._cond:
            return len(self._queue)

    def _submit(self, entry: E) -> E:
        """Queue ``entry`` and wait until its batch ran; raises the entry's error."""
        with self._cond:
            if self._closed:
                raise RuntimeError(self.closed_message)
            self._queue.append(entry)
            if self._thread is None:
                self._thread = self._last = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
                self._thread.start()
            else:
                self._cond.notify()
        entry.done.acquire()
        if entry.error is not None:
            raise entry.error
        return entry

    def close(self) -> None:
        """Run what is queued, stop the thread and wait for it; later entries raise RuntimeError."""
        with self._cond:
            self._closed = True
            thread = self._last
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _next_batch(self) -> list[E] | None:
        """The oldest queued entries (up to ``max_batch``), once there are any; None: stop (closed or idle)."""
        with self._cond:
            while not self._queue:
                if self._closed or (not self._cond.wait(self._idle_s) and not self._queue):
                    self._thread = None
                    return None
            return [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]

    @abstractmethod
    def _loop(self) -> None:
        """Runs batches from :meth:`_next_batch` until it answers None, releasing every entry's ``done``."""
