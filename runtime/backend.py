"""The device-backend interface: arenas, streams, events, and the batch copy kernel.

A backend is the only place that knows where memory lives and how bytes move. The transfer engine
(`runtime.transfer`) drives any backend through this interface::

    Backend.create_arena(name, slot_bytes, num_slots)  -> Arena     one buffer per tier
    Backend.create_stream(name)                        -> Stream    ordered queue of work
    Stream.enqueue(fn) / record_event() / wait_event(ev)            FIFO; cross-stream waits
    Event.query() / synchronize(timeout) / await event              completion, loop-friendly
    Backend.copy_slots(src, src_ids, dst, dst_ids, staging)         one batch, one call
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from .arena import Arena
from .freelist import SlotIds

__all__ = ["DEFAULT_TIMEOUT_S", "Backend", "CopyInfo", "Event", "Stream"]

#: Bound applied to every wait that is given no explicit timeout.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class CopyInfo:
    """What one batch copy did: how many contiguous runs, and which kernel moved them."""

    runs: int
    kernel: str


class Event(abc.ABC):
    """Marks a point in a stream. Done once all work enqueued before it has finished.

    An event carries the error of the work it follows, if any: waiting on it raises that error.
    """

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the event has completed (successfully or not). Never blocks."""

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> None:
        """Block the calling thread until done (at most `timeout`, default DEFAULT_TIMEOUT_S).

        Raises WaitTimeoutError on timeout and the work's error (a TransferError) if it failed.
        """

    @abc.abstractmethod
    async def wait(self, timeout: float | None = None) -> None:
        """Wait without blocking the event loop; raises like `synchronize`.

        Cancelling the waiting task does not affect the event or the work before it.
        """

    @abc.abstractmethod
    def exception(self) -> BaseException | None:
        """The error the event completed with, or None (also None while pending)."""

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()


class Stream(abc.ABC):
    """An ordered queue of work. Items run one after another, in submission order."""

    name: str

    @abc.abstractmethod
    def enqueue(self, fn: Callable[[], None]) -> Event:
        """Run `fn` on the stream after everything enqueued before; returns its completion event.

        An exception from `fn` completes the event with a TransferError. Raises EngineClosedError
        after close().
        """

    @abc.abstractmethod
    def enqueue_work(self, fn: Callable[[BaseException | None], None]) -> Event:
        """Engine-level enqueue: `fn` always runs, and receives the error of a failed
        `wait_event` before it (or None) so that it can skip its copy and still clean up.
        """

    @abc.abstractmethod
    def record_event(self) -> Event:
        """An event that completes once all work enqueued so far has finished."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work enqueued after this call starts only once `event` has completed.

        If `event` fails or does not complete within the stream's wait timeout, the next work
        item is not run and its event completes with that error.
        """

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all work enqueued so far has finished. Raises WaitTimeoutError."""

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Finish queued work, then stop. Idempotent. Raises WaitTimeoutError."""


class Backend(abc.ABC):
    """A device backend: where arenas live, and the streams and kernel that move their bytes."""

    name: str

    @abc.abstractmethod
    def create_arena(
        self, name: str, slot_bytes: int, num_slots: int, *, kind: str = "device"
    ) -> Arena:
        """Allocate (and touch) an arena of `num_slots` slots of `slot_bytes` bytes.

        `kind` is "device" (the accelerator's memory) or "pinned" (host memory the device can
        copy from asynchronously); on the cpu backend both are host memory.
        Raises ArenaError for bad sizes or when the memory cannot be allocated.
        """

    @abc.abstractmethod
    def create_stream(self, name: str) -> Stream:
        """A new stream. Raises EngineClosedError after close()."""

    @abc.abstractmethod
    def copy_slots(
        self, src: Arena, src_ids: SlotIds, dst: Arena, dst_ids: SlotIds, staging: Any
    ) -> CopyInfo:
        """Copy slots `src_ids` of `src` into slots `dst_ids` of `dst`, on the calling thread.

        Ids are validated by the caller. `staging` is a buffer from `create_staging`.
        """

    @abc.abstractmethod
    def create_staging(self, nbytes: int) -> Any:
        """A staging buffer of `nbytes` for `copy_slots`."""

    def compute_event(self) -> Event | None:
        """An event after the compute queued so far on the caller's compute stream, for copies
        out of pages that compute wrote to wait on (``after=[...]``). None where compute is
        synchronous (the cpu backend): the bytes are already in place."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources. Idempotent."""
