"""The transfer engine: batches of slots moved between arenas, one copy call per batch.

    submit() --> [pending heap: priority, seq] --dispatch (<= max_inflight)--> stream per direction
    submit_call()                                                              | wait_event(after)
                                                                               | copy_slots(batch)
                                                                               | or the job's fn
    handle  <------------ one completion (call_soon_threadsafe) per batch -----+
                          (per group: small write-backs queued back to back on a cpu
                           stream run as one kernel call, MERGE_MAX_BYTES at most)

    submit_async() --> [pending heap] --dispatch (<= max_external)--> a task on the loop

Every byte copy of the store is a job of this engine, so that one set of priorities, bounds,
cancellation rules and statistics covers them all. Three kinds (``TransferStats.kind``):

* ``copy``: the backend's batch copy kernel between two arenas of equal slot size;
* ``call``: a host function run on the stream of its two arenas (a codec encoding host slots
  into cold ones, decoding them into device slots; the slot sizes may differ);
* ``async``: a coroutine run on the submitting loop (a remote peer reading or writing host
  slots over the network), bounded apart (``max_external``), so that a slow peer never holds
  the streams' in-flight budget.

Ownership: the slots of a batch are *busy* from submit() until its copy has really finished (or it
was dropped before it started). A busy slot cannot be freed (SlotBusyError). Cancelling a task that
awaits a handle never stops a copy that has started; `handle.cancel()` drops a batch only while it
is still pending. (An arena whose slots were handed over to their owner, `Arena.hand_over`, keeps
no busy counts: the owner's own state says what is in flight.)

This file stays whole (over 400 lines): the handle and the engine share one lock and one
state machine (pending -> running -> done / failed / cancelled) across the three job kinds,
and splitting them would spread that machine over modules.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterable
from typing import Any

import numpy as np

from tierkv.transports.errors import InvalidInputError

from .arena import Arena
from .backend import DEFAULT_TIMEOUT_S, Backend, Event, Stream
from .cpu_copy import DEFAULT_STAGING_BYTES
from .cpu_stream import CpuEvent, CpuStream, complete_events
from .errors import (
    ArenaMismatchError,
    EngineClosedError,
    InvalidSlotError,
    TransferCancelledError,
    TransferError,
    WaitTimeoutError,
)
from .freelist import SlotIds, as_slot_ids, distinct_ids
from .priority import Priority
from .stats import EngineStats, TransferStats

__all__ = ["TransferEngine", "TransferHandle"]

_PENDING, _RUNNING, _DONE, _FAILED, _CANCELLED = "pending", "running", "done", "failed", "cancelled"

#: Copies queued back to back on one cpu stream are merged into one kernel call while the group
#: stays within this many bytes: one call, one completion pass and one wakeup per group instead
#: of per batch (the first batch of a group completes with the last: at most ~0.4 ms later at
#: 10 GB/s). Larger batches gain nothing from it and run alone.
MERGE_MAX_BYTES = 4 << 20

#: What a store's engine passes as ``inline_bytes``: on the cpu backend a copy this small,
#: submitted while the engine is idle, runs on the submitting thread (no stream thread woken,
#: no completion handed back across threads). An engine's default is 0: off. Measured on the
#: shared 2-core box (issue 26; 24 KiB pages, submit and await): inline costs the process
#: 0.36-0.72x the CPU of a stream thread's copy at 24 KiB-3 MiB, and the caller's thread
#: 0.6-1.0x up to 384 KiB, 1.4x at 768 KiB, 1.7x at 1.5 MiB; 1 MiB takes a SmolLM2 step's
#: write-behind (30 pages, 720 KiB) inline. A copy that large is worth a thread only where a
#: free core overlaps it with compute.
INLINE_MAX_BYTES = 1 << 20


class TransferHandle:
    """One submitted batch. Await it (or `wait`/`synchronize`) for completion.

    Awaiting raises TransferError if the copy failed, TransferCancelledError if it was dropped,
    WaitTimeoutError if the wait ran out (the transfer itself carries on).
    """

    __slots__ = (
        "_callbacks",
        "_deps",
        "_engine",
        "_event",
        "_fn",
        "_loop",
        "_priority",
        "_result",
        "_seq",
        "_staging",
        "_state",
        "_stats",
        "dst",
        "dst_ids",
        "src",
        "src_ids",
    )

    def __init__(
        self,
        engine: TransferEngine,
        seq: int,
        priority: Priority,
        src: Arena,
        src_ids: SlotIds,
        dst: Arena,
        dst_ids: SlotIds,
        deps: list[Event],
        kind: str = "copy",
        fn: Callable[[], Any] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._engine = engine
        self._fn = fn  # "call": run on the stream; "async": returns the awaitable to run
        self._loop = loop
        self._result: Any = None
        self._seq = seq
        self._priority = priority
        self.src, self.src_ids, self.dst, self.dst_ids = src, src_ids, dst, dst_ids
        self._deps = deps
        self._event = CpuEvent()
        self._state = _PENDING
        self._staging: Any = None
        self._callbacks: list[Callable[[TransferHandle], None]] = []
        side, ids = (src, src_ids) if src_ids.size else (dst, dst_ids)  # a remote side has none
        self._stats = TransferStats(
            priority=priority,
            pages=int(ids.size),
            bytes=int(ids.size) * side.slot_bytes,
            submitted_at=time.perf_counter(),
            kind=kind,
        )

    def __repr__(self) -> str:
        return (
            f"<TransferHandle #{self._seq} {self.src.name}->{self.dst.name} "
            f"pages={self.src_ids.size} {self._priority.name} {self._state}>"
        )

    def __lt__(self, other: TransferHandle) -> bool:  # heap order
        return (self._priority, self._seq) < (other._priority, other._seq)

    @property
    def priority(self) -> Priority:
        """Priority the batch is dispatched with (raised when a more urgent batch waits on it)."""
        return self._priority

    @property
    def state(self) -> str:
        """One of "pending", "running", "done", "failed", "cancelled"."""
        return self._state

    @property
    def event(self) -> Event:
        """Completion event; usable in `after=[...]` and in `Stream.wait_event`."""
        return self._event

    @property
    def stats(self) -> TransferStats:
        """Per-transfer statistics (timings filled in as the batch progresses)."""
        return self._stats

    def done(self) -> bool:
        """True once the copy has finished, failed or been dropped; its slots are no longer busy."""
        return self._event.query()

    def exception(self) -> BaseException | None:
        """The error the transfer ended with, or None."""
        return self._event.exception()

    def result(self) -> Any:
        """What the job's function returned (``call`` and ``async`` jobs; None for a copy, or
        while not done)."""
        return self._result

    def cancel(self) -> bool:
        """Drop the batch if it has not been dispatched yet. True when dropped.

        A dispatched batch always completes; its slots stay busy until it has.
        """
        return self._engine._cancel(self)

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call `fn(handle)` once the handle is done (now, if it already is).

        Runs on the thread that completes the transfer (a stream worker); keep it short and
        thread-safe, e.g. `arena.free(ids)`.
        """
        with self._engine._lock:
            if not self._event.query():
                self._callbacks.append(fn)
                return
        fn(self)

    async def wait(self, timeout: float | None = None) -> TransferStats:
        """Wait without blocking the loop (at most `timeout`, default the engine's timeout)."""
        await self._event.wait(self._engine.timeout if timeout is None else timeout)
        return self._stats

    def synchronize(self, timeout: float | None = None) -> TransferStats:
        """Block the calling thread until done; raises like `wait`."""
        self._event.synchronize(self._engine.timeout if timeout is None else timeout)
        return self._stats

    def __await__(self) -> Generator[Any, None, TransferStats]:
        return self.wait().__await__()


def _pin(src: Arena, s_ids: SlotIds, dst: Arena, d_ids: SlotIds) -> None:
    """Mark a batch's slots busy (both or neither). Raises InvalidSlotError (unallocated)."""
    src.pin_for_transfer(s_ids, "source")
    try:
        dst.pin_for_transfer(d_ids, "destination")
    except BaseException:
        src.unpin_after_transfer(s_ids)
        raise


class _Job:
    """A batch's work on its stream: a class, not a closure, so that the engine recognises its
    own copies queued on a stream (`TransferEngine._take_mergeable`)."""

    __slots__ = ("engine", "handle", "stream")

    def __init__(self, engine: TransferEngine, handle: TransferHandle, stream: Stream) -> None:
        self.engine, self.handle, self.stream = engine, handle, stream

    def __call__(self, dep_error: BaseException | None) -> None:
        self.engine._run_job(self.handle, self.stream, dep_error)


class TransferEngine:
    """Moves batches of slots between arenas of one backend.

    `max_inflight` bounds the batches dispatched to streams at once, and so the staging buffers
    (one each, `staging_bytes`). Pending batches wait in a priority heap (DEMAND first).
    Use as `async with TransferEngine(backend) as engine:` or call `aclose()`/`close()`.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        max_inflight: int = 4,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_external: int = 4,
        inline_bytes: int = 0,
    ) -> None:
        if max_inflight < 1:
            raise InvalidInputError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_external < 1:
            raise InvalidInputError(f"max_external must be >= 1, got {max_external}")
        self.backend = backend
        self.max_inflight = max_inflight
        self.max_external = max_external
        self.staging_bytes = staging_bytes
        self.inline_bytes = inline_bytes  # cpu copies up to this run on the submitting thread
        self.timeout = timeout
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._pending: list[TransferHandle] = []
        self._pending_ext: list[TransferHandle] = []  # async jobs: their own lane and bound
        self._inflight_ext = 0
        self._outstanding: set[TransferHandle] = set()
        self._inflight = 0
        self._staging_pool: list[Any] = []
        self._staging_made = 0
        self._streams: dict[tuple[int, int], Stream] = {}
        self._stats = EngineStats()
        self._tasks: set[asyncio.Future[Any]] = set()  # async jobs running on the loop
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<TransferEngine {self.backend.name} inflight={self._inflight}/{self.max_inflight} "
            f"pending={len(self._pending)} closed={self._closed}>"
        )

    @property
    def closed(self) -> bool:
        """True once close()/aclose() has begun."""
        return self._closed

    @property
    def inflight(self) -> int:
        """Batches dispatched to streams and not yet finished."""
        return self._inflight

    @property
    def pending(self) -> int:
        """Batches waiting to be dispatched."""
        return len(self._pending) + len(self._pending_ext)

    def runs_inline(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` with no dependency, submitted now from this thread,
        would run right there (:meth:`submit`'s inline path): a cpu backend, at most
        ``inline_bytes``, nothing queued or running. The answer holds until something else is
        submitted (completions on the stream threads only make the engine idler)."""
        with self._lock:
            return (
                not self._closed
                and self.backend.name == "cpu"
                and nbytes <= self.inline_bytes
                and not self._inflight
                and not self._pending
            )

    def copy_now(
        self,
        src: Arena,
        src_slots: object,
        dst: Arena,
        dst_slots: object,
        *,
        priority: Priority = Priority.DEMAND,
    ) -> TransferStats | None:
        """The copy :meth:`submit` would run inline, run here with no handle, event or
        completion callback (a synchronous caller, such as a step's group load, needs none):
        returns its statistics, counted as a finished batch, or None with nothing done where
        it would not run inline now (:meth:`runs_inline`). Raises what ``submit`` raises for
        bad arenas or slots (nothing done then), TransferError when the copy failed (counted
        failed; the destination slots may hold part of it)."""
        self._check_copy(src, dst)
        s_ids, d_ids = self._slot_ids(src, src_slots, dst, dst_slots, True)
        n = len(s_ids)
        st = TransferStats(  # (an enum's call costs a microsecond: not when it is one)
            priority if type(priority) is Priority else Priority(priority),
            n,
            n * src.slot_bytes,
            time.perf_counter(),
        )
        _pin(src, s_ids, dst, d_ids)  # (checks that the slots are allocated)
        with self._lock:
            if (
                self._closed
                or self.backend.name != "cpu"
                or st.bytes > self.inline_bytes
                or self._inflight
                or self._pending
            ):
                staging = None
            else:
                if self._staging_pool:
                    staging = self._staging_pool.pop()
                else:
                    staging = self.backend.create_staging(self.staging_bytes)
                    self._staging_made += 1
                self._inflight += 1
                self._stats.submitted += 1
                self._stats.max_inflight_seen = max(self._stats.max_inflight_seen, 1)
        if staging is None:
            src.unpin_after_transfer(s_ids)
            dst.unpin_after_transfer(d_ids)
            return None
        st.dispatched_at = st.started_at = time.perf_counter()
        error: TransferError | None = None
        try:
            info = self.backend.copy_slots(src, s_ids, dst, d_ids, staging)
        except Exception as exc:
            error = TransferError(f"copy {src.name}->{dst.name} failed: {exc!r}")
            error.__cause__ = exc
        else:
            st.runs, st.kernel = info.runs, info.kernel
        st.finished_at = time.perf_counter()
        src.unpin_after_transfer(s_ids)
        dst.unpin_after_transfer(d_ids)
        with self._lock:
            self._inflight -= 1
            self._staging_pool.append(staging)
            self._stats.record(st, _FAILED if error is not None else _DONE)
            self._dispatch_locked()
        if error is not None:
            raise error
        return st

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the aggregated statistics."""
        with self._lock:
            return self._stats.snapshot()

    def stream(self, src: Arena, dst: Arena) -> Stream:
        """The stream that carries copies from `src` to `dst` (one per direction, made lazily).

        Raises EngineClosedError after close.
        """
        with self._lock:
            if self._closed:
                raise EngineClosedError("transfer engine is closed")
            return self._stream_locked(src, dst)

    def _stream_locked(self, src: Arena, dst: Arena) -> Stream:
        key = (id(src), id(dst))
        stream = self._streams.get(key)
        if stream is None:
            stream = self.backend.create_stream(f"{src.name}->{dst.name}")
            self._streams[key] = stream
        return stream

    def submit(
        self,
        src: Arena,
        src_slots: object,
        dst: Arena,
        dst_slots: object,
        *,
        priority: Priority = Priority.PREFETCH,
        after: Iterable[Event | TransferHandle] = (),
    ) -> TransferHandle:
        """Queue a copy of `src[src_slots]` into `dst[dst_slots]` as one batch.

        `after`: events or handles that must complete first (a failure of one fails this batch).
        The slots must be allocated; they are busy until the handle is done.
        Raises EngineClosedError, ArenaMismatchError, InvalidSlotError (wrong dtype or shape,
        out of range, duplicated destination, unallocated, or a slot both read and written).
        Nothing changes when it raises.
        """
        self._check_copy(src, dst)
        return self._queue(src, src_slots, dst, dst_slots, priority, after, "copy", None, None)

    def submit_call(
        self,
        src: Arena,
        src_slots: object,
        dst: Arena,
        dst_slots: object,
        fn: Callable[[], Any],
        *,
        priority: Priority = Priority.PREFETCH,
        after: Iterable[Event | TransferHandle] = (),
    ) -> TransferHandle:
        """Queue a host function that reads `src[src_slots]` and writes `dst[dst_slots]` (a
        codec's encode or decode: the slot sizes may differ) as one batch of the stream from
        `src` to `dst`: dispatched by priority within `max_inflight`, its slots busy until it
        has run, cancellable while pending, counted in the statistics (kind ``"call"``).
        `fn` runs on the stream's thread; what it returns is `handle.result()`, what it raises
        fails the handle with TransferError. Raises like `submit`; nothing changes then.
        """
        if self._closed:
            raise EngineClosedError("transfer engine is closed")
        return self._queue(src, src_slots, dst, dst_slots, priority, after, "call", fn, None)

    def submit_async(
        self,
        src: Arena,
        src_slots: object,
        dst: Arena,
        dst_slots: object,
        start: Callable[[], Awaitable[Any]],
        *,
        priority: Priority = Priority.PREFETCH,
    ) -> TransferHandle:
        """Queue a job that runs on the calling event loop: `start()` is called when the job is
        dispatched and its awaitable awaited (a remote peer reading `src` slots or writing
        `dst` slots over the network; `src` and `dst` may be the same arena when one side is
        remote: give the other side no slots). Async jobs have a lane of their own, bounded by
        `max_external`, so that a slow peer never holds the copy streams. What the awaitable
        returns is `handle.result()`; what it raises fails the handle with TransferError; a
        pending job is dropped by `handle.cancel()`, a running one is cancelled by
        `aclose(cancel_pending=True)` only. Must be called on the loop's thread.
        Raises like `submit`; nothing changes then.
        """
        if self._closed:
            raise EngineClosedError("transfer engine is closed")
        loop = asyncio.get_running_loop()
        return self._queue(src, src_slots, dst, dst_slots, priority, (), "async", start, loop)

    def _queue(
        self,
        src: Arena,
        src_slots: object,
        dst: Arena,
        dst_slots: object,
        priority: Priority,
        after: Iterable[Event | TransferHandle],
        kind: str,
        fn: Callable[[], Any] | None,
        loop: asyncio.AbstractEventLoop | None,
    ) -> TransferHandle:
        s_ids, d_ids = self._slot_ids(src, src_slots, dst, dst_slots, kind == "copy")
        deps = [d.event if isinstance(d, TransferHandle) else d for d in after]
        _pin(src, s_ids, dst, d_ids)
        with self._lock:
            if self._closed:
                src.unpin_after_transfer(s_ids)
                dst.unpin_after_transfer(d_ids)
                raise EngineClosedError("transfer engine is closed")
            handle = TransferHandle(
                self,
                next(self._seq),
                Priority(priority),
                src,
                s_ids,
                dst,
                d_ids,
                deps,
                kind,
                fn,
                loop,
            )
            self._raise_dep_priorities(after, handle._priority)
            self._outstanding.add(handle)
            self._stats.submitted += 1
            inline = self._inline_locked(handle)
            if not inline:
                heapq.heappush(self._pending_ext if kind == "async" else self._pending, handle)
                self._dispatch_locked()
        if inline:
            self._run_inline(handle)
        return handle

    def _check_copy(self, src: Arena, dst: Arena) -> None:
        """Raise EngineClosedError after close, ArenaMismatchError for slots of two sizes."""
        if self._closed:
            raise EngineClosedError("transfer engine is closed")
        if src.slot_bytes != dst.slot_bytes:
            raise ArenaMismatchError(
                f"slot sizes differ: {src.name!r} has {src.slot_bytes} B, "
                f"{dst.name!r} has {dst.slot_bytes} B"
            )

    def _slot_ids(
        self, src: Arena, src_slots: object, dst: Arena, dst_slots: object, copy: bool
    ) -> tuple[SlotIds, SlotIds]:
        """A batch's slots as checked id arrays. Raises ArenaMismatchError (another backend's
        arena), InvalidSlotError (bad ids; for a ``copy``, counts that differ; a slot both read
        and written)."""
        if src.backend != self.backend.name or dst.backend != self.backend.name:
            raise ArenaMismatchError(
                f"arenas {src.name!r} ({src.backend}) and {dst.name!r} ({dst.backend}) "
                f"do not belong to the {self.backend.name!r} backend"
            )
        s_ids = as_slot_ids(src_slots, src.num_slots, what=f"source slots in {src.name!r}")
        d_ids = as_slot_ids(dst_slots, dst.num_slots, what=f"destination slots in {dst.name!r}")
        if copy and s_ids.size != d_ids.size:
            raise InvalidSlotError(f"{s_ids.size} source slots but {d_ids.size} destination slots")
        if src is dst and np.intersect1d(s_ids, d_ids).size:
            raise InvalidSlotError(f"arena {src.name!r}: a slot is both read and written")
        return s_ids, d_ids

    def _inline_locked(self, handle: TransferHandle) -> bool:
        """Whether `handle` runs now on the submitting thread (marked running if so): a copy
        of at most `inline_bytes` with no dependency, on a backend whose copies are host
        memcpy (cpu), while nothing else is queued or running (so no batch is overtaken).
        Measured (issue 26): waking a stream thread and taking its completion back costs the
        loop more than the copy of a few pages."""
        if (
            handle._stats.kind != "copy"
            or handle._deps
            or handle._stats.bytes > self.inline_bytes
            or self._inflight
            or self._pending
            or self.backend.name != "cpu"
        ):
            return False
        self._start_locked(handle)
        return True

    def _start_locked(self, handle: TransferHandle) -> None:
        """A batch is dispatched: its staging buffer, running, counted in flight."""
        if self._staging_pool:
            handle._staging = self._staging_pool.pop()
        else:
            handle._staging = self.backend.create_staging(self.staging_bytes)
            self._staging_made += 1
        handle._state = _RUNNING
        handle._stats.dispatched_at = time.perf_counter()
        self._inflight += 1
        self._stats.max_inflight_seen = max(self._stats.max_inflight_seen, self._inflight)

    def _run_inline(self, handle: TransferHandle) -> None:
        """Run a copy :meth:`_inline_locked` took, here and now, and finish it."""
        started = time.perf_counter()
        errors = self._copy_group([handle])
        handle._stats.started_at, handle._stats.finished_at = started, time.perf_counter()
        self._finish_group([handle], errors)

    async def transfer(
        self,
        src: Arena,
        src_slots: object,
        dst: Arena,
        dst_slots: object,
        *,
        priority: Priority = Priority.PREFETCH,
        after: Iterable[Event | TransferHandle] = (),
        timeout: float | None = None,
    ) -> TransferStats:
        """`submit` and wait. Raises like `submit` and `TransferHandle.wait`."""
        handle = self.submit(src, src_slots, dst, dst_slots, priority=priority, after=after)
        return await handle.wait(timeout)

    def _raise_dep_priorities(
        self, after: Iterable[Event | TransferHandle], priority: Priority
    ) -> None:
        # Priority inheritance: a pending batch that a more urgent one waits on goes first, so the
        # head of the heap never waits on a batch behind it.
        changed = False
        for dep in after:
            if (
                isinstance(dep, TransferHandle)
                and dep._state == _PENDING
                and dep._priority > priority
            ):
                dep._priority = priority
                changed = True
        if changed:
            heapq.heapify(self._pending)

    def _dispatch_locked(self) -> None:
        while self._pending_ext and self._inflight_ext < self.max_external:
            handle = heapq.heappop(self._pending_ext)
            if handle._state != _PENDING:
                continue  # cancelled while queued
            handle._state = _RUNNING
            handle._stats.dispatched_at = time.perf_counter()
            self._inflight_ext += 1
            assert handle._loop is not None
            try:
                handle._loop.call_soon_threadsafe(self._start_async, handle)
            except RuntimeError as exc:  # the loop is closed: the job can never run
                err = EngineClosedError(f"{handle!r}: its event loop is closed")
                err.__cause__ = exc
                self._inflight_ext -= 1
                handle._state = _FAILED
                self._stats.record(handle._stats, _FAILED)
                self._outstanding.discard(handle)
                handle._callbacks = []  # their loop is gone with it
                handle._event.complete(err)
        while self._pending and self._inflight < self.max_inflight:
            handle = heapq.heappop(self._pending)
            if handle._state != _PENDING:
                continue  # cancelled while queued
            self._start_locked(handle)
            stream = self._stream_locked(handle.src, handle.dst)
            for dep in handle._deps:
                stream.wait_event(dep)
            job = _Job(self, handle, stream)
            if isinstance(stream, CpuStream):
                stream.enqueue_job(job)  # the job completes its handle: no event of its own
            else:
                stream.enqueue_work(job)

    def _run_job(
        self, handle: TransferHandle, stream: Stream, dep_error: BaseException | None
    ) -> None:
        """On the stream's worker: run the batch (and, for a small copy, the copies queued right
        behind it, merged into one kernel call), then finish them all with one wakeup."""
        started = time.perf_counter()
        group = [handle]
        errors: list[BaseException | None] = [dep_error]
        if dep_error is None and handle._fn is not None:
            try:
                handle._result = handle._fn()
            except Exception as exc:
                errors = [self._job_error("job", handle, exc)]
        elif dep_error is None:
            if isinstance(stream, CpuStream) and handle.src is not handle.dst:
                group += self._take_mergeable(handle, stream)
            errors = self._copy_group(group)
        finished = time.perf_counter()
        for h in group:
            h._stats.started_at, h._stats.finished_at = started, finished
        self._finish_group(group, errors)

    def _take_mergeable(self, handle: TransferHandle, stream: CpuStream) -> list[TransferHandle]:
        """The copies of the same priority queued right behind `handle` on its stream, while
        the group stays within MERGE_MAX_BYTES (a copy with `after` events has a wait before it,
        which ends the run). Same priority only: a batch never completes later because less
        urgent ones were merged behind it. Write-backs only: a merged group completes at once,
        so a load merged with the ones behind it lands when the last of them does, later than
        alone (merged prefetches made 5.5% of the demo's loads late instead of 1.2%)."""
        budget = MERGE_MAX_BYTES - handle._stats.bytes
        if budget <= 0 or handle._priority != Priority.WRITEBACK:
            return []
        priority = handle._priority

        def accept(fn: Callable[[BaseException | None], None]) -> bool:
            nonlocal budget
            if not (
                isinstance(fn, _Job)
                and fn.engine is self
                and fn.handle._fn is None
                and fn.handle._priority == priority
            ):
                return False
            budget -= fn.handle._stats.bytes
            return budget >= 0

        taken = stream.take_following(accept)
        return [fn.handle for fn in taken if isinstance(fn, _Job)]

    def _copy_group(self, group: list[TransferHandle]) -> list[BaseException | None]:
        """Copy the batches of `group` (one stream: same two arenas), in one kernel call when
        there are several and no destination slot repeats; one by one otherwise, or when the
        merged call fails (so that each batch gets its own error). Returns each batch's error."""
        first = group[0]
        if len(group) > 1:
            dst_ids = np.concatenate([h.dst_ids for h in group])
            if distinct_ids(dst_ids, first.dst.num_slots):
                src_ids = np.concatenate([h.src_ids for h in group])
                try:
                    info = self.backend.copy_slots(
                        first.src, src_ids, first.dst, dst_ids, first._staging
                    )
                except Exception:
                    pass  # copied again one by one below, so that each batch gets its own error
                else:
                    for h in group:  # a merged batch reports its group's runs
                        h._stats.runs, h._stats.kernel = info.runs, info.kernel
                    return [None] * len(group)
        errors: list[BaseException | None] = []
        for h in group:
            try:
                info = self.backend.copy_slots(h.src, h.src_ids, h.dst, h.dst_ids, h._staging)
            except Exception as exc:
                errors.append(self._job_error("copy", h, exc))
            else:
                h._stats.runs, h._stats.kernel = info.runs, info.kernel
                errors.append(None)
        return errors

    @staticmethod
    def _job_error(what: str, handle: TransferHandle, exc: Exception) -> TransferError:
        error = TransferError(f"{what} {handle.src.name}->{handle.dst.name} failed: {exc!r}")
        error.__cause__ = exc
        return error

    def _start_async(self, handle: TransferHandle) -> None:
        """On the loop: run an async job to its end (a task of the engine, not the caller's)."""
        handle._stats.started_at = time.perf_counter()

        async def run() -> Any:
            assert handle._fn is not None
            return await handle._fn()

        task = asyncio.ensure_future(run())
        with self._lock:
            self._tasks.add(task)

        def done(t: asyncio.Future[Any]) -> None:  # also when cancelled before it started
            with self._lock:
                self._tasks.discard(t)
            handle._stats.finished_at = time.perf_counter()
            error: BaseException | None = None
            if t.cancelled():
                error = TransferCancelledError(f"{handle!r} cancelled while running")
            elif (exc := t.exception()) is not None:
                error = TransferError(f"job {handle.src.name}->{handle.dst.name} failed: {exc!r}")
                error.__cause__ = exc
            else:
                handle._result = t.result()
            self._finish(handle, error)

        task.add_done_callback(done)

    def _finish(self, handle: TransferHandle, error: BaseException | None) -> None:
        self._finish_group([handle], [error])

    def _finish_group(
        self, group: list[TransferHandle], errors: list[BaseException | None]
    ) -> None:
        """Release the slots, account, dispatch more, then wake waiters (each loop once for the
        whole group) and run the done callbacks."""
        for handle in group:
            handle.src.unpin_after_transfer(handle.src_ids)
            handle.dst.unpin_after_transfer(handle.dst_ids)
        callbacks: list[tuple[Callable[[TransferHandle], None], TransferHandle]] = []
        with self._lock:
            for handle, error in zip(group, errors):
                if handle._state == _RUNNING and handle._stats.kind == "async":
                    self._inflight_ext -= 1
                elif handle._state == _RUNNING:
                    self._inflight -= 1
                    self._staging_pool.append(handle._staging)
                    handle._staging = None
                if isinstance(error, TransferCancelledError):
                    handle._state = _CANCELLED
                else:
                    handle._state = _FAILED if error is not None else _DONE
                self._stats.record(handle._stats, handle._state)
                self._outstanding.discard(handle)
                callbacks += [(fn, handle) for fn in handle._callbacks]
                handle._callbacks = []
            self._dispatch_locked()
            complete_events([(h._event, e) for h, e in zip(group, errors)])
        for fn, handle in callbacks:
            fn(handle)

    def _cancel(self, handle: TransferHandle) -> bool:
        with self._lock:
            if handle._state != _PENDING:
                return False
            handle._state = _CANCELLED  # lazily removed from the heap
        self._finish(handle, TransferCancelledError(f"{handle!r} dropped before it started"))
        return True

    def cancel_pending(self) -> int:
        """Drop every batch not yet dispatched; returns how many were dropped."""
        with self._lock:
            queued = [h for h in self._pending + self._pending_ext if h._state == _PENDING]
        return sum(self._cancel(h) for h in queued)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted batch is done. Raises WaitTimeoutError."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                handles = list(self._outstanding)
            if not handles:
                return
            for h in handles:
                try:
                    await h._event.wait(max(0.0, deadline - time.monotonic()))
                except WaitTimeoutError:
                    raise WaitTimeoutError(
                        f"{len(self._outstanding)} transfers not done after {limit} s"
                    ) from None
                except Exception:
                    pass  # its error belongs to whoever awaits the handle

    def _drain_sync(self, timeout: float | None) -> None:
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                handles = list(self._outstanding)
            if not handles:
                return
            for h in handles:
                try:
                    h._event.synchronize(max(0.0, deadline - time.monotonic()))
                except WaitTimeoutError:
                    raise WaitTimeoutError(
                        f"{len(self._outstanding)} transfers not done after {limit} s"
                    ) from None
                except Exception:
                    pass

    def _begin_close(self, cancel_pending: bool) -> list[Stream]:
        with self._lock:
            self._closed = True
        if cancel_pending:
            self.cancel_pending()
        with self._lock:
            return list(self._streams.values())

    async def aclose(self, timeout: float | None = None, *, cancel_pending: bool = False) -> None:
        """Stop accepting work, finish (or with `cancel_pending`, drop) queued batches, wait for
        in-flight ones, stop the streams. Idempotent. Raises WaitTimeoutError.
        """
        streams = self._begin_close(cancel_pending)
        if cancel_pending:  # async jobs can stop mid-way (a peer's read): cancel them too
            with self._lock:
                tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
        await self.drain(timeout)
        for stream in streams:
            await asyncio.to_thread(stream.close, timeout)
        with self._lock:
            self._streams.clear()

    def close(self, timeout: float | None = None, *, cancel_pending: bool = False) -> None:
        """Blocking `aclose` for callers without a loop."""
        streams = self._begin_close(cancel_pending)
        self._drain_sync(timeout)
        for stream in streams:
            stream.close(timeout)
        with self._lock:
            self._streams.clear()

    async def __aenter__(self) -> TransferEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose(cancel_pending=exc[0] is not None)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel_pending=exc[0] is not None)
