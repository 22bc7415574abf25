"""Batches of slot I/O on a small thread pool, finished off the event loop and awaitable from it.

A batch is split into at most one chunk per I/O thread (the queue depth); the last chunk to end
runs the batch's `finish` (index and counters) on its own thread and resolves the batch's
``concurrent.futures.Future``. An asyncio caller awaits it through `settle`, woken by
``call_soon_threadsafe`` (``asyncio.wrap_future``), never by polling.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from .errors import DiskClosedError
from .io import OS_ERROR, Scratch

T = TypeVar("T")
Item = TypeVar("Item")
Outcome = tuple[int, str]


class IoPool:
    """`threads` I/O threads, each with its own aligned scratch buffers."""

    def __init__(self, threads: int, payload_bytes: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tierkv-disk")
        self._scratch: queue.SimpleQueue[Scratch] = queue.SimpleQueue()
        self._all = [Scratch(payload_bytes) for _ in range(threads)]
        for s in self._all:
            self._scratch.put(s)
        self._lock = threading.Lock()
        self._inflight: set[Future[Any]] = set()
        self._closed = False

    def run(
        self,
        items: Sequence[Item],
        fn: Callable[[Sequence[Item], Scratch], list[Outcome]],
        finish: Callable[[list[Outcome]], T],
    ) -> Future[T]:
        """Run `fn` over `items` in chunks; `finish(outcomes)` (one per item, in order) gives the
        result. Raises DiskClosedError when the pool is shut (nothing ran then)."""
        op: Future[T] = Future()
        op.set_running_or_notify_cancel()  # a running future cannot be cancelled from outside
        n = len(items)
        if n == 0:
            self._settle(op, finish, [])
            return op
        parts = min(self.threads, n)
        step = -(-n // parts)
        chunks = [items[i : i + step] for i in range(0, n, step)]
        results: list[list[Outcome] | None] = [None] * len(chunks)
        left = [len(chunks)]
        count_lock = threading.Lock()

        def chunk(part: Sequence[Item]) -> list[Outcome]:
            scratch = self._scratch.get()
            try:
                return fn(part, scratch)
            finally:
                self._scratch.put(scratch)

        def done(i: int, f: Future[list[Outcome]]) -> None:
            exc = f.exception()
            results[i] = f.result() if exc is None else [(OS_ERROR, repr(exc))] * len(chunks[i])
            with count_lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                outcomes = [o for r in results for o in (r or ())]
                self._settle(op, finish, outcomes)

        with self._lock:
            if self._closed:
                raise DiskClosedError("the disk I/O pool is shut")
            self._inflight.add(op)
            futures = [self._pool.submit(chunk, c) for c in chunks]
        for i, f in enumerate(futures):
            f.add_done_callback(functools.partial(done, i))
        return op

    def _settle(
        self, op: Future[T], finish: Callable[[list[Outcome]], T], out: list[Outcome]
    ) -> None:
        try:
            result = finish(out)
        except BaseException as exc:  # a bug in finish must still wake the waiter
            op.set_exception(exc)
        else:
            op.set_result(result)
        finally:
            with self._lock:
                self._inflight.discard(op)

    def call(self, fn: Callable[[Scratch], T]) -> Future[T]:
        """Run `fn(scratch)` on an I/O thread (the scan at open)."""

        def job() -> T:
            scratch = self._scratch.get()
            try:
                return fn(scratch)
            finally:
                self._scratch.put(scratch)

        return self._pool.submit(job)

    def shut(self) -> list[Future[Any]]:
        """Refuse new batches; the batches still in flight (wait for them, then `close`)."""
        with self._lock:
            self._closed = True
            return list(self._inflight)

    def close_within(self, timeout: float | None, then: Callable[[], None]) -> None:
        """`shut`, wait for the batches in flight (at most `timeout` s; None: no bound), then
        `close` and ``then()``. Batches still running at the deadline (a hung disk) keep the
        threads and buffers: `close` and ``then()`` run when the last of them ends (on a
        thread of its own: the pool's shutdown joins its threads), and this returns now."""
        _, late = wait(self.shut(), timeout)
        if not late:
            self.close()
            then()
            return
        left, lock = [len(late)], threading.Lock()

        def finish() -> None:
            self.close()
            then()

        def ended(_: Future[Any]) -> None:  # (on the I/O thread that ended the batch)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                threading.Thread(target=finish, name="tierkv-disk-close").start()

        for f in late:
            f.add_done_callback(ended)

    def close(self) -> None:
        """Stop the threads (after the in-flight batches ended) and free the buffers."""
        self._pool.shutdown(wait=True)
        for s in self._all:
            s.close()
        self._all = []


async def settle(op: Future[T]) -> T:
    """Await `op`. When the awaiting task is cancelled, the batch still runs to its end (the I/O
    threads may be reading into the caller's buffers) and its index changes are made; the
    cancellation is raised once nothing touches the buffers any more."""
    waiter = asyncio.wrap_future(op)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        while not waiter.done():
            try:
                await asyncio.wait([waiter])
            except asyncio.CancelledError:
                continue
        if not waiter.cancelled():
            waiter.exception()  # retrieved: the cancellation is what the caller sees
        raise
