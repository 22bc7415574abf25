"""Pushing pages that leave the host tier to a remote tier: staged, batched, best-effort.

The eviction that lets a page go must not wait on the network, and the page's slot is reused as
soon as it returns. So an offered page is copied (one gather per offer) into a staging buffer of
our own, and a background task publishes staged pages in batches::

    eviction: offer(victims) --copy--> staging [ p0 | p1 | ... | p(cap-1) ] --publish--> remote
              (waits at most `wait`    pending: (key, staging slot) ...      one call per batch,
               for room, else drops)                                         bounded by timeout

After a wait ran out, offers stop waiting (they stage what fits and drop the rest) until half
the buffer is free again: a remote slower than the evictions costs them one wait, not one each.

Failures (remote down, full, slow) are counted, never raised into the eviction.

The staging buffer is the remote tier's medium on this side: its rows are reserved for the
pages of an offer (:meth:`Pusher.reserve`), written by the move registered from the host to the
remote (:func:`push_move`: one gather, a host-function job of the transfer engine, that commits
the rows with the pages' checksums once it has ended, or returns them), and published by the
background task. Attached to a store (:meth:`Pusher.start` with the tier core's
:class:`~tierkv.remote_glue.RemoteGlue`), the gather is that move (``RemoteGlue.move_out``)
and each publish call a job of the store's transfer engine (``run_remote``); on its own (no
glue) both run inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.failures import FailureLog
from tierkv.jobs import when_done
from tierkv.page_source import PageSource, publish_checked
from tierkv.remote_glue import RemoteGlue
from tierkv.runtime import Priority, TransferEngine, TransferHandle
from tierkv.tier import Batch
from tierkv.tier_names import REMOTE

__all__ = ["PushCounters", "Pusher", "Staged", "push_move"]


@dataclass(slots=True)
class PushCounters:
    """Monotonic counters of a :class:`Pusher`."""

    offered: int = 0  # content pages offered by evictions
    staged: int = 0  # copied into the staging buffer
    dropped: int = 0  # offered but not staged (no room within the wait)
    pushed: int = 0  # newly stored by the remote
    batches: int = 0  # publish calls
    errors: int = 0  # publish calls that failed (their pages are lost to the remote)
    last_error: str = ""


class Pusher:
    """Publishes offered pages to ``source`` in the background.

    Args:
        source: where pages go.
        page_bytes: bytes per page.
        capacity: staging buffer size, in pages.
        batch: the most pages of one publish call.
        wait: the longest an offer waits for staging room, in seconds.
        timeout: the bound of one publish call, in seconds.
    """

    def __init__(
        self,
        source: PageSource,
        page_bytes: int,
        *,
        capacity: int = 256,
        batch: int = 64,
        wait: float = 0.05,
        timeout: float = 5.0,
    ) -> None:
        if capacity < 1 or batch < 1:
            raise InvalidInputError("capacity and batch must be at least 1")
        self.source = source
        self.staging: npt.NDArray[np.uint8] = np.zeros((capacity, page_bytes), np.uint8)
        self.batch, self.wait, self.timeout = batch, wait, timeout
        self.counters = PushCounters()
        self._failures = FailureLog("tierkv.remote")
        self._free = list(range(capacity))
        self._pending: list[tuple[bytes, int]] = []
        self._staged: set[bytes] = set()
        self._sums: dict[bytes, int] = {}  # staged page -> its checksum, when offered with one
        self._work = asyncio.Event()
        self._room = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._busy = 0  # pages in the publish call now
        self._shedding = False  # offers do not wait for room (see offer)
        self._capacity = capacity
        self._closed = False
        self._glue: RemoteGlue | None = None  # the store's: its engine runs the jobs

    def start(self, glue: RemoteGlue | None = None) -> None:
        """Start the background publisher (on the running loop); with a store's ``glue``,
        every gather and publish is a job of its transfer engine."""
        if glue is not None:
            self._glue = glue
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self, flush: float = 0.0) -> None:
        """Stop; staged pages are published first for at most ``flush`` seconds."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        if flush > 0 and self.pending:
            self._task = task  # flush() waits only while the publisher runs
            await self.flush(flush)
            self._task = None
        task.cancel()  # bounded: a publish that does not end on cancel is left behind
        await asyncio.wait([task], timeout=self.timeout)
        if task.done() and not task.cancelled():
            task.result()  # (a failure of its own is raised, as before)

    @property
    def pending(self) -> int:
        """Pages staged and not yet published (or being published)."""
        return len(self._pending) + self._busy

    async def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every staged page went out or failed;
        True when none is left."""
        deadline = time.monotonic() + timeout
        while self.pending and self._task is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), left)
        return not self.pending

    async def offer(
        self,
        keys: Sequence[bytes],
        array: npt.NDArray[np.uint8],
        slots: Sequence[int],
        sums: Sequence[int] = (),
    ) -> int:
        """Stage ``array[slots[i]]`` as page ``keys[i]`` (pages already staged are skipped);
        returns the pages staged. Waits at most ``wait`` seconds for room; the rest is dropped.
        ``sums``: the pages' checksums, declared to the source with them. The caller keeps the
        source slots unchanged until this returns."""
        if self._closed or self._task is None:
            return 0
        todo = [(k, s) for k, s in zip(keys, slots) if k not in self._staged]
        self.counters.offered += len(todo)
        if len(self._free) < len(todo) and self.wait > 0 and not self._shedding:
            deadline = time.monotonic() + self.wait
            while len(self._free) < len(todo) and (left := deadline - time.monotonic()) > 0:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), left)
            # the remote is slower than the evictions: stop waiting until half the buffer is
            # free again (one wait per backlog, not one per eviction)
            self._shedding = len(self._free) < len(todo)
            todo = [(k, s) for k, s in todo if k not in self._staged]  # staged meanwhile
        reserved = self.reserve([k for k, _ in todo])
        self.counters.dropped += len(todo) - len(reserved)
        if not reserved:
            return 0
        slot_of = dict(todo)
        src = [slot_of[k] for k, _ in reserved]
        declared = dict(zip(keys, sums)) if len(sums) == len(keys) else {}
        batch_sums = [declared[k] for k, _ in reserved] if declared else []
        staged = Staged(self, reserved)
        if self._glue is not None:  # the move (host, remote): its job commits the rows
            batch = Batch([k for k, _ in reserved], self._glue.host_arena, src, batch_sums)
            await self._glue.move_out(REMOTE, staged, batch)
        else:
            self.staging[[r for _, r in reserved]] = array[src]
            self.commit(reserved, [True] * len(reserved), batch_sums)
        return len(reserved)

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Reserve a staging row for each key not staged yet, as many as are free (the first
        keys); returns (key, row) pairs. A reserved key counts as staged (a second offer of it
        skips it) until :meth:`commit` or :meth:`abort`."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._staged]
        fit = todo[: len(self._free)]
        if not fit:
            return []
        rows = self._free[len(self._free) - len(fit) :]
        del self._free[len(self._free) - len(fit) :]
        self._staged.update(fit)
        return list(zip(fit, rows, strict=True))

    def commit(
        self, reserved: Sequence[tuple[bytes, int]], ok: Sequence[bool], sums: Sequence[int] = ()
    ) -> None:
        """Queue the reserved rows whose page was written (``ok``) for publishing, with their
        checksums (``sums``, one per reservation, declared to the source; empty: computed from
        the staged bytes); return the others' rows."""
        sums = list(sums) if len(sums) == len(reserved) else []
        back = [(k, r) for (k, r), o in zip(reserved, ok, strict=True) if not o]
        for i, ((k, r), o) in enumerate(zip(reserved, ok, strict=True)):
            if o:
                self._pending.append((k, r))
                if sums:
                    self._sums[k] = sums[i]
        self.counters.staged += len(reserved) - len(back)
        if back:
            self.abort(back)
        if len(back) < len(reserved):
            self._work.set()

    def abort(self, reserved: Sequence[tuple[bytes, int]]) -> None:
        """Return reserved rows unused."""
        for k, r in reserved:
            self._staged.discard(k)
            self._free.append(r)
        if reserved:
            self._room.set()

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is staged here (reserved, or waiting to be published)."""
        return [k in self._staged for k in keys]

    def drop(self, keys: Sequence[bytes]) -> int:
        """Drop staged pages still waiting to be published (not the batch being published);
        returns how many went (counted as dropped)."""
        gone = set(keys)
        keep = [(k, r) for k, r in self._pending if k not in gone]
        out = [(k, r) for k, r in self._pending if k in gone]
        self._pending = keep
        for k, _ in out:
            self._sums.pop(k, None)
        self.counters.dropped += len(out)
        self.abort(out)
        return len(out)

    def shed(self, n: int) -> int:
        """Drop the oldest pages waiting to be published until ``n`` rows are free; returns
        the pages dropped."""
        short = n - len(self._free)
        return self.drop([k for k, _ in self._pending[: max(0, short)]]) if short > 0 else 0

    async def _run(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self._pending:
                take, self._pending = self._pending[: self.batch], self._pending[self.batch :]
                await self._publish(take)

    async def _publish(self, take: list[tuple[bytes, int]]) -> None:
        keys, slots = [k for k, _ in take], [s for _, s in take]
        pop = self._sums.pop
        got = [pop(k, -1) for k in keys]
        sums = got if -1 not in got else []  # (else computed from the staged bytes)
        self.counters.batches += 1
        self._busy = len(take)
        try:
            # the bound is inside the call: when it returns, nothing reads the rows any more
            def call() -> Awaitable[int]:
                return asyncio.wait_for(
                    publish_checked(self.source, keys, self.staging, slots, sums), self.timeout
                )

            glue = self._glue
            stored = await (glue.run_remote(call) if glue is not None else call())
            if type(stored) is not int:
                raise InvalidTypeError(f"publish answered {type(stored).__name__}, not an int")
            self.counters.pushed += max(0, min(stored, len(keys)))
        except Exception as exc:  # a failing source (hostile answers too) is counted, not raised
            self.counters.errors += 1
            self.counters.last_error = self._failures.report(
                "remote push", exc, tier="remote", keys=keys
            )
        finally:
            self._busy = 0
            self._staged.difference_update(keys)
            self._free.extend(slots)
            if self._shedding and len(self._free) * 2 >= self._capacity:
                self._shedding = False
            self._room.set()


@dataclass(frozen=True, slots=True)
class Staged:
    """The remote end of a push: the pusher and the staging rows it reserved, one per key of
    the batch, in order."""

    pusher: Pusher
    reserved: list[tuple[bytes, int]]


def push_move(engine: TransferEngine, end: Staged, batch: Batch) -> TransferHandle:
    """The move host -> remote: one gather of the batch's host slots into the staging rows of
    ``end`` (a host-function job; the host slots are the job's until it ends), whose rows are
    committed with the batch's checksums (``batch.sums``, declared to the source at publish)
    once it ended, or returned when it failed or was cancelled. The job's result: True per
    page staged (published later, in the background)."""
    rows = [r for _, r in end.reserved]
    src, arena, staging = list(batch.slots), batch.arena, end.pusher.staging
    if len(rows) != len(src):
        end.pusher.abort(end.reserved)
        raise InvalidInputError(f"{len(src)} pages for {len(rows)} staging rows")

    def gather() -> list[bool]:
        staging[rows] = arena.array[src]
        return [True] * len(rows)

    try:
        handle = engine.submit_call(arena, src, arena, [], gather, priority=Priority.WRITEBACK)
    except BaseException:  # nothing queued: the rows go back
        end.pusher.abort(end.reserved)
        raise

    def settle() -> None:
        ok = handle.state == "done" and handle.exception() is None
        end.pusher.commit(end.reserved, [ok] * len(rows), batch.sums)

    when_done(handle, settle)
    return handle
