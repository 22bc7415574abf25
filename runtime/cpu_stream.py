"""CPU streams and events: one worker thread per stream; completion reaches asyncio once per event.

loop thread                         stream worker thread
-----------                         --------------------
stream.enqueue(copy) ---deque--->   copy()            (GIL released inside the kernel)
                                      take_following() (the running work may take the work
                                                        queued right behind it along)
await event  <--call_soon_threadsafe-- complete_events()  (one wakeup per loop for all the
                                                          events completed together)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .backend import DEFAULT_TIMEOUT_S, Event
from .errors import EngineClosedError, RuntimeEngineError, WaitTimeoutError
from .worker_stream import WorkerStream, WorkFn

__all__ = ["CpuEvent", "CpuStream", "WorkFn", "complete_events"]


def _resolve_all(settled: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for fut, error in settled:
        if fut.done():  # its waiter was cancelled or timed out
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


def complete_events(done: Iterable[tuple[CpuEvent, BaseException | None]]) -> None:
    """Complete each event with its error (None: success), waking each loop that waits on any
    of them once for all of them (one `call_soon_threadsafe`). Producer side: a stream worker,
    or the engine finishing a group of batches."""
    wake: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]]
    wake = {}
    for event, error in done:
        with event._lock:
            event._error = error
            event._done.set()
            waiters, event._waiters = event._waiters, {}
        for loop, futures in waiters.items():
            wake.setdefault(loop, []).extend((fut, error) for fut in futures)
    for loop, settled in wake.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody to wake
            loop.call_soon_threadsafe(_resolve_all, settled)


class CpuEvent(Event):
    """An event completed by a stream worker thread; awaitable from any number of loops.

    Each waiting task awaits a future of its own (cancelling it touches nobody else's), under
    `asyncio.timeout` (a timer, no extra task or shield hops); `complete` resolves all of one
    loop's futures in one `call_soon_threadsafe`.
    """

    __slots__ = ("_done", "_error", "_lock", "_waiters")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}

    def __repr__(self) -> str:
        state = "pending" if not self.query() else ("failed" if self._error else "done")
        return f"<CpuEvent {state}>"

    def query(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def synchronize(self, timeout: float | None = None) -> None:
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        if not self._done.wait(limit):
            raise WaitTimeoutError(f"event not done after {limit} s")
        if self._error is not None:
            raise self._error

    async def wait(self, timeout: float | None = None) -> None:
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        if not self._done.is_set():
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            with self._lock:
                pending = not self._done.is_set()
                if pending:
                    self._waiters.setdefault(loop, []).append(fut)
            if pending:
                try:
                    async with asyncio.timeout(limit):
                        await fut
                except TimeoutError:
                    raise WaitTimeoutError(f"event not done after {limit} s") from None
                finally:
                    if not fut.done() or fut.cancelled():  # cancelled or timed out: unregister
                        self._forget(loop, fut)
        if self._error is not None:
            raise self._error

    def _forget(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        with self._lock:
            futures = self._waiters.get(loop)
            if futures is not None and fut in futures:
                futures.remove(fut)
                if not futures:
                    del self._waiters[loop]

    def complete(self, error: BaseException | None = None) -> None:
        """Complete the event (worker thread). Wakes each waiting loop exactly once."""
        complete_events(((self, error),))


@dataclass(slots=True)
class _Item:
    fn: WorkFn | None  # None: a marker (record_event) or, with wait_on, a cross-stream wait
    event: CpuEvent | None  # None: work that signals its own completion (enqueue_job)
    wait_on: Event | None = None


class CpuStream(WorkerStream):
    """A FIFO of work run by one daemon worker thread."""

    def __init__(self, name: str, *, wait_timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name
        self.wait_timeout = wait_timeout
        self._taken: list[CpuEvent | None] = []  # events of the items the running work took
        self._start_worker(f"tierkv-stream-{name}")

    def __repr__(self) -> str:
        return f"<CpuStream {self.name!r} queued={len(self._queue)} closed={self._closed}>"

    def enqueue_work(self, fn: WorkFn) -> Event:
        event = CpuEvent()
        self._push(fn, event)
        return event

    def enqueue_job(self, fn: WorkFn) -> None:
        """`enqueue_work` without a completion event, for work that signals its own (the
        transfer engine's batches complete their handles): one event fewer per batch.
        Raises EngineClosedError after close()."""
        self._push(fn, None)

    def record_event(self) -> Event:
        event = CpuEvent()
        self._push(None, event)
        return event

    def wait_event(self, event: Event) -> None:
        self._push(None, None, wait_on=event)

    def take_following(self, accept: Callable[[WorkFn], bool]) -> list[WorkFn]:
        """For the work item now running (call it from that work, on the worker thread): take
        the work queued right behind it, in order, while `accept(fn)` holds; a marker, a
        `wait_event` or the first refused item ends the run. The caller runs what it took; their
        events complete with the running item's. `accept` runs under the stream's lock: keep it
        a plain check. Raises RuntimeEngineError from any other thread."""
        if threading.current_thread() is not self._thread:
            raise RuntimeEngineError(f"stream {self.name!r}: take_following off its worker")
        taken: list[WorkFn] = []
        with self._cond:
            while self._queue:
                item = self._queue[0]
                if item.fn is None or not accept(item.fn):
                    break
                self._queue.popleft()
                taken.append(item.fn)
                self._taken.append(item.event)
        return taken

    def close(self, timeout: float | None = None) -> None:
        self._stop_worker(timeout)

    def _push(
        self, fn: WorkFn | None, event: CpuEvent | None, *, wait_on: Event | None = None
    ) -> None:
        with self._cond:
            if self._closed:
                raise EngineClosedError(f"stream {self.name!r} is closed")
            self._queue.append(_Item(fn, event, wait_on))
            self._cond.notify()

    def _run(self) -> None:
        while (item := self._next_item()) is not None:  # None: closed and drained
            if item.fn is None:
                if item.wait_on is not None:
                    self._do_wait(item.wait_on)
                if item.event is not None:
                    item.event.complete(None)
                continue
            error = self._call(item.fn)
            taken, self._taken = self._taken, []
            events = [ev for ev in (item.event, *taken) if ev is not None]
            if events:
                complete_events([(ev, error) for ev in events])

    def _do_wait(self, target: Event) -> None:
        try:
            target.synchronize(self.wait_timeout)
        except RuntimeEngineError as exc:
            self._wait_failed(exc)
