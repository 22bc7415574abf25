"""CUDA streams and events, awaitable from asyncio without blocking the loop.

    loop thread                 launcher thread (per stream)        waiter thread (per stream)
    -----------                 ----------------------------        --------------------------
    stream.enqueue(fn) -deque-> fn() launches on the cupy stream
                                cupy event recorded after it  -->   event.synchronize() (GIL
    await ev  <------------------------ call_soon_threadsafe -----  released), FIFO order

Two ways to learn that a CUDA event is done (`strategy`):

    "thread"  the stream's waiter thread synchronizes its events in FIFO order and wakes each
              waiting loop once per event (call_soon_threadsafe). One thread per stream, not
              per wait. Events are created with cudaEventBlockingSync by default, so the waiter
              sleeps in the driver instead of spinning a core.
    "poll"    no thread: `query()` asks `event.done`; `await ev` polls with exponential backoff
              (`POLL_FIRST_S` doubling up to `POLL_MAX_S`) on the loop.

No host callback ever calls CUDA. Cross-stream waits between CUDA events are device-side
(cudaStreamWaitEvent): the host never blocks for them. An event is only waited on once it has
been *recorded* (a wait on an unrecorded CUDA event is a silent no-op: the classic source of KV
corruption), so a wait on a CudaEvent first waits, bounded, for its record.

The file stays whole (over 400 lines): the event, the copy stream with its launcher and waiter
threads, and the compute stream share one protocol for recording and waking, and splitting them
would put the record/wait ordering rules in two places.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tierkv.transports.errors import InvalidInputError, InvalidTypeError

from .backend import DEFAULT_TIMEOUT_S, Event
from .cpu_stream import CpuEvent
from .errors import EngineClosedError, WaitTimeoutError
from .worker_stream import WorkerStream, WorkFn, transfer_error

__all__ = [
    "POLL_FIRST_S",
    "POLL_MAX_S",
    "WAIT_STRATEGIES",
    "ComputeStream",
    "CudaEvent",
    "CudaStream",
    "check_strategy",
    "pick_wait_strategy",
]

#: The event-waiting strategies.
WAIT_STRATEGIES = ("thread", "poll")
#: Poll backoff: first delay after the first miss, and the cap.
POLL_FIRST_S = 20e-6
POLL_MAX_S = 500e-6


def check_strategy(strategy: str) -> str:
    """`strategy` if it names a waiting strategy. Raises ValueError otherwise."""
    if strategy not in WAIT_STRATEGIES:
        raise InvalidInputError(f"unknown wait strategy {strategy!r}; use one of {WAIT_STRATEGIES}")
    return strategy


def pick_wait_strategy(figures: dict[str, dict[str, float]], *, stall_limit_s: float = 1e-3) -> str:
    """The strategy to make default, from measurements `{strategy: {"latency_s", "stall_s"}}`.

    A strategy whose worst loop stall is over `stall_limit_s` is out; of the rest, the lower
    wake-up latency wins (ties: "thread"). Raises ValueError when nothing was measured.
    """
    if not figures:
        raise InvalidInputError("no measurements")
    ok = {k: v for k, v in figures.items() if v["stall_s"] <= stall_limit_s} or figures
    return min(sorted(ok), key=lambda k: (ok[k]["latency_s"], k != "thread"))


class CudaEvent(CpuEvent):
    """A point on a CUDA stream. `cuda_event` is the recorded `cupy.cuda.Event` (None until the
    stream's launcher has recorded it). Awaitable per the stream's strategy; raises like CpuEvent.
    """

    __slots__ = ("_cuda", "_error_after", "_mode", "_recorded")

    def __init__(self, mode: str = "thread") -> None:
        super().__init__()
        self._mode = check_strategy(mode)
        self._cuda: Any = None
        self._error_after: BaseException | None = None
        self._recorded = threading.Event()

    def __repr__(self) -> str:
        state = "pending" if not self.query() else ("failed" if self._error else "done")
        rec = "recorded" if self._recorded.is_set() else "unrecorded"
        return f"<CudaEvent {self._mode} {rec} {state}>"

    @property
    def cuda_event(self) -> Any:
        """The `cupy.cuda.Event`, once recorded (else None)."""
        return self._cuda

    @property
    def recorded(self) -> bool:
        """True once the CUDA event has been recorded on its stream."""
        return self._recorded.is_set()

    def _mark_recorded(self, cuda_event: Any, error: BaseException | None = None) -> None:
        self._cuda = cuda_event
        self._error_after = error
        self._recorded.set()

    def wait_recorded(self, timeout: float) -> None:
        """Block until recorded. Raises WaitTimeoutError."""
        if not self._recorded.wait(timeout):
            raise WaitTimeoutError(f"CUDA event not recorded after {timeout} s")

    def query(self) -> bool:
        if self._done.is_set():
            return True
        if self._mode != "poll" or not self._recorded.is_set():
            return False
        try:
            finished = bool(self._cuda.done)
        except Exception as exc:  # a sticky CUDA error surfaces here
            self.complete(transfer_error("CUDA event query failed", exc))
            return True
        if finished:
            self.complete(self._error_after)
        return finished

    def synchronize(self, timeout: float | None = None) -> None:
        if self._mode != "poll":
            super().synchronize(timeout)
            return
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = POLL_FIRST_S
        while not self.query():
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"event not done after {limit} s")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        if self._error is not None:
            raise self._error

    async def wait(self, timeout: float | None = None) -> None:
        if self._mode != "poll":
            await super().wait(timeout)
            return
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.0  # first retry: just yield to the loop
        while not self.query():
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"event not done after {limit} s")
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, POLL_FIRST_S), POLL_MAX_S)
        if self._error is not None:
            raise self._error


class _Waiter:
    """The "thread" strategy: one thread that completes a stream's events in FIFO order."""

    def __init__(self, name: str, device: int) -> None:
        self._queue: deque[CudaEvent] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._device = device
        self._thread = threading.Thread(target=self._run, name=f"tierkv-wait-{name}", daemon=True)
        self._thread.start()

    def push(self, ev: CudaEvent) -> None:
        with self._cond:
            self._queue.append(ev)
            self._cond.notify()

    def close(self, timeout: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WaitTimeoutError(f"event waiter not done after {timeout} s")

    def _run(self) -> None:
        import cupy

        with cupy.cuda.Device(self._device):
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if not self._queue:
                        return
                    ev = self._queue.popleft()
                try:
                    ev.cuda_event.synchronize()  # cudaEventSynchronize, GIL released
                except Exception as exc:
                    ev.complete(transfer_error("CUDA event synchronize failed", exc))
                    continue
                ev.complete(ev._error_after)


@dataclass(slots=True)
class _Item:
    kind: str  # "work" | "record" | "wait"
    fn: WorkFn | None
    event: CudaEvent | None
    wait_on: Any = None


def _as_cupy_stream(stream: Any, device: int) -> Any:
    import cupy

    if stream is None:
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return stream
    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream, device)
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return cupy.cuda.ExternalStream(int(stream.cuda_stream), device)
    if hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    raise InvalidTypeError(f"not a CUDA stream: {stream!r}")


class CudaStream(WorkerStream):
    """A non-blocking CUDA stream fed in FIFO order by one launcher thread.

    `enqueue(fn)` runs `fn` on the launcher with this stream current (CuPy launches and copies
    go to it); its event completes when the device work `fn` queued has finished.
    """

    def __init__(
        self,
        name: str,
        *,
        device: int = 0,
        strategy: str = "thread",
        blocking_sync: bool = True,
        wait_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import cupy

        self.name = name
        self.device = device
        self.strategy = check_strategy(strategy)
        self.blocking_sync = blocking_sync
        self.wait_timeout = wait_timeout
        with cupy.cuda.Device(device):
            self.cuda = cupy.cuda.Stream(non_blocking=True)
        self._waiter = _Waiter(name, device) if strategy == "thread" else None
        self._start_worker(f"tierkv-cuda-{name}")

    def __repr__(self) -> str:
        return (
            f"<CudaStream {self.name!r} device={self.device} {self.strategy} "
            f"queued={len(self._queue)} closed={self._closed}>"
        )

    def enqueue_work(self, fn: WorkFn) -> Event:
        return self._push("work", fn)

    def record_event(self) -> Event:
        return self._push("record", None)

    def wait_event(self, event: Any) -> None:
        """Work enqueued after this starts after `event`: a CudaEvent or `cupy.cuda.Event`
        (device-side wait) or any other Event (the launcher waits for it on the host).
        """
        self._push("wait", None, wait_on=event)

    def close(self, timeout: float | None = None) -> None:
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        if self._stop_worker(limit) and self._waiter is not None:
            self._waiter.close(limit)

    def _push(self, kind: str, fn: WorkFn | None, *, wait_on: Any = None) -> CudaEvent:
        ev = CudaEvent(self.strategy)
        with self._cond:
            if self._closed:
                raise EngineClosedError(f"stream {self.name!r} is closed")
            self._queue.append(_Item(kind, fn, None if kind == "wait" else ev, wait_on))
            self._cond.notify()
        return ev

    def _run(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device), self.cuda:
            while (item := self._next_item()) is not None:  # None: closed and drained
                if item.kind == "wait":
                    self._do_wait(item.wait_on)
                    continue
                assert item.event is not None
                error: BaseException | None = None
                if item.kind == "work":
                    assert item.fn is not None
                    error = self._call(item.fn)
                self._record(item.event, error)

    def _record(self, ev: CudaEvent, error: BaseException | None) -> None:
        import cupy

        try:
            cuda_event = cupy.cuda.Event(block=self.blocking_sync, disable_timing=True)
            cuda_event.record(self.cuda)
        except Exception as exc:
            ev.complete(transfer_error(f"stream {self.name!r}: event record failed", exc))
            return
        ev._mark_recorded(cuda_event, error)
        if self._waiter is not None:
            self._waiter.push(ev)

    def _do_wait(self, target: Any) -> None:
        import cupy

        try:
            if isinstance(target, CudaEvent):
                target.wait_recorded(self.wait_timeout)
                if target._error_after is not None:
                    raise target._error_after
                if target.cuda_event is None:  # recording failed: its error is set
                    target.synchronize(0)
                self.cuda.wait_event(target.cuda_event)  # device-side
            elif isinstance(target, cupy.cuda.Event):
                self.cuda.wait_event(target)
            else:
                target.synchronize(self.wait_timeout)
        except Exception as exc:  # a runtime error, or CuPy's
            self._wait_failed(exc)


class ComputeStream:
    """The caller's compute stream (torch's or CuPy's), as the runtime sees it.

    `record_event()` marks "the compute that wrote these pages" (pass it in `after=[...]` of a
    write-back); `wait_event(load)` makes later compute wait for a load, on the device.
    """

    def __init__(
        self,
        stream: Any = None,
        *,
        device: int = 0,
        strategy: str = "thread",
        blocking_sync: bool = True,
        wait_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.device = device
        self.cuda = _as_cupy_stream(stream, device)
        self.strategy = check_strategy(strategy)
        self.blocking_sync = blocking_sync
        self.wait_timeout = wait_timeout
        self._waiter = _Waiter("compute", device) if strategy == "thread" else None

    def __repr__(self) -> str:
        return f"<ComputeStream device={self.device} ptr={self.cuda.ptr:#x} {self.strategy}>"

    def record_event(self) -> CudaEvent:
        """An event after all work queued on the compute stream so far (recorded now)."""
        import cupy

        cuda_event = cupy.cuda.Event(block=self.blocking_sync, disable_timing=True)
        cuda_event.record(self.cuda)
        ev = CudaEvent(self.strategy)
        ev._mark_recorded(cuda_event)
        if self._waiter is not None:
            self._waiter.push(ev)
        return ev

    def wait_event(self, event: Any) -> None:
        """Compute queued after this call runs after `event`.

        A CudaEvent or `cupy.cuda.Event` is waited on by the device (the host does not block,
        beyond waiting, bounded, for the event to be recorded). Any other Event (a transfer
        handle's) is waited on by the host if it is not done yet: await it first to keep the
        loop free. Raises the event's error (TransferError) or WaitTimeoutError.
        """
        import cupy

        if isinstance(event, CudaEvent):
            event.wait_recorded(self.wait_timeout)
            if event._error_after is not None:
                raise event._error_after
            if event.cuda_event is None:
                event.synchronize(0)
            self.cuda.wait_event(event.cuda_event)
        elif isinstance(event, cupy.cuda.Event):
            self.cuda.wait_event(event)
        else:
            event.synchronize(self.wait_timeout)

    def close(self) -> None:
        """Stop the waiter thread. Idempotent."""
        if self._waiter is not None:
            self._waiter.close(self.wait_timeout)
            self._waiter = None
