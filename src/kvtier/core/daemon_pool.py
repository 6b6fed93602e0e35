"""A thread pool that never keeps the process alive, and whose threads can be waited for with
a bound.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one of
them stuck in a read on a hung mount (a FUSE daemon that stopped answering) keeps a replica
from ever exiting. `DaemonPool` keeps the same `Executor` contract (`submit`, `map`,
`shutdown`) on daemon threads, and `join(timeout_s)` waits for them at most that long.

Threads start on the first `submit`, all at once (a thread inherits the CPU affinity of the
thread that starts it, as with `ThreadPoolExecutor`, whose threads start on submits); each
runs `initializer` first (which must not raise).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

from kvtier.core.clock import deadline_in, seconds_left

__all__ = ["DaemonPool"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool(Executor):
    """`threads` daemon threads named `<name>_<i>` running submitted calls in order."""

    def __init__(
        self, threads: int, name: str, initializer: Callable[[], None] | None = None
    ) -> None:
        if threads < 1:
            raise ValueError(f"a pool needs at least one thread, got {threads}")
        self._size = threads
        self._name = name
        self._initializer = initializer
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue `fn(*args, **kwargs)`; raises RuntimeError after `shutdown`."""
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: cannot submit after shutdown")
            if not self._threads:
                self._start_threads()
            self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; cancel the queued ones (`cancel_futures`) or let them run; wait
        for the threads without a bound (`wait`; `join` bounds the wait)."""
        with self._lock:
            if not self._shut:
                self._shut = True
                if cancel_futures:
                    self._cancel_queued()
                for _ in self._threads:
                    self._jobs.put(None)
        if wait:
            self.join(None)

    def join(self, timeout_s: float | None) -> bool:
        """Wait up to `timeout_s` (None: without a bound) for the threads to end, after
        `shutdown`; False when some are still running (each named in a warning)."""
        deadline = deadline_in(timeout_s)
        for thread in self._threads:
            thread.join(seconds_left(deadline))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.warning("kvtier: %s still running after %.1f s, left behind", stuck, timeout_s)
        return not stuck

    def _start_threads(self) -> None:
        for i in range(self._size):
            thread = threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].cancel()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
