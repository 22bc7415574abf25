"""`WorkerStream`: what the cpu and cuda streams share on the host side.

A stream is a FIFO of items run in order by one worker thread (the cpu stream runs the work
itself; the cuda stream's launcher queues device work). Both take the next item the same way,
call a work item the same way (it receives the error of a failed wait before it and decides
what to skip; what it raises becomes the error its event completes with), carry the failure of
a wait to the next work item, and close with a bound. Those pieces are here, once; each stream
keeps what differs: its items, how it completes an event (a host event now, or a CUDA event
recorded after the device work), how it waits for another stream's event.
"""

from __future__ import annotations

import abc
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .backend import DEFAULT_TIMEOUT_S, Event, Stream
from .errors import RuntimeEngineError, TransferError, WaitTimeoutError

__all__ = ["WorkFn", "WorkerStream", "transfer_error"]

# Work items receive the error of a failed wait before them (or None) and decide what to skip.
WorkFn = Callable[[BaseException | None], None]


def transfer_error(what: str, exc: BaseException) -> TransferError:
    """A TransferError saying ``what`` failed, caused by ``exc``."""
    err = TransferError(f"{what}: {exc!r}")
    err.__cause__ = exc
    return err


class WorkerStream(Stream):
    """The queue, worker thread and error carrying of a stream (see the module docstring).

    A subclass calls :meth:`_start_worker` at the end of its constructor and implements
    ``_run`` (the worker's loop, taking items with :meth:`_next_item`).
    """

    name: str
    wait_timeout: float

    def _start_worker(self, thread_name: str) -> None:
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._pending_error: BaseException | None = None  # a failed wait, for the next work
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @abc.abstractmethod
    def _run(self) -> None:
        """The worker's loop: take items with :meth:`_next_item` until closed."""

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed

    def enqueue(self, fn: Callable[[], None]) -> Event:
        def run(dep_error: BaseException | None) -> None:
            if dep_error is None:
                fn()

        return self.enqueue_work(run)

    def synchronize(self, timeout: float | None = None) -> None:
        self.record_event().synchronize(timeout)

    def _stop_worker(self, timeout: float | None) -> bool:
        """Close: the worker runs what is queued, then ends. Waits for it at most ``timeout``
        seconds (the default bound when None); False when called from the worker itself (it
        cannot wait for itself). Raises WaitTimeoutError when the worker did not end in time."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._cond.notify_all()
        if threading.current_thread() is self._thread:
            return False
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        self._thread.join(limit)
        if self._thread.is_alive():
            raise WaitTimeoutError(f"stream {self.name!r}: queued work not done after {limit} s")
        return True

    def _next_item(self) -> Any:
        """The next queued item, waiting for one; None once closed and drained (worker)."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            return self._queue.popleft() if self._queue else None

    def _call(self, fn: WorkFn) -> BaseException | None:
        """Run a work item with the error pending before it (a failed wait); returns the error
        its event completes with: the pending one, or what the work raised (a runtime error as
        it is, any other as a TransferError)."""
        error, self._pending_error = self._pending_error, None
        try:
            fn(error)
        except RuntimeEngineError as exc:
            return exc
        except Exception as exc:
            return transfer_error(f"stream {self.name!r}: work failed", exc)
        return error

    def _wait_failed(self, exc: BaseException) -> None:
        """A wait for another event failed: the next work item gets a TransferError."""
        if isinstance(exc, RuntimeEngineError):
            err = TransferError(f"stream {self.name!r}: an event waited on failed: {exc}")
            err.__cause__ = exc
            self._pending_error = err
        else:
            self._pending_error = transfer_error(f"stream {self.name!r}: wait failed", exc)
