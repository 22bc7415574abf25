"""Loads into the device: pages with a readable lower copy copied (host) or decoded (cold)
into new device slots, each by the move registered from its tier's medium to the device.

A load's copies are owned by a task of this class, not by the caller: a cancelled caller never
frees a slot a copy still writes, and the pins the load took for it are given back when the
copies end. Part of the tier core (:class:`tierkv.tiers.TierSet`, which places pages and calls
:meth:`DeviceLoads.load` under its device lock), built from its
:class:`~tierkv.core_context.CoreContext`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

from tierkv.core_context import CoreContext
from tierkv.errors import PageStateError, StoreTimeoutError, TierFullError
from tierkv.eviction import DeviceEviction
from tierkv.jobs import job_done, within
from tierkv.keys import PageKey
from tierkv.lower_tiers import ColdStorage
from tierkv.policies import Key
from tierkv.prefault import Prefaulter
from tierkv.runtime import Priority, TransferHandle, TransferStats
from tierkv.tier import Batch, Target, copy_move
from tierkv.tier_names import DEVICE, HOST

__all__ = ["DeviceLoads"]

Sources = dict[str, tuple[list[PageKey], list[int]]]  # a load's sources: tier -> keys, slots
Work = list[tuple[str, int, TransferHandle]]  # its copies: (source tier, pages, handle)
Done = list[tuple[str, int, TransferStats]]  # those that ended well: (tier, pages, stats)
Clean = Callable[[list[Key]], bool]  # (built once: a Callable[...] costs a microsecond a call)


class DeviceLoads:
    """The moves of one tier core into its device tier."""

    def __init__(
        self,
        ctx: CoreContext,
        evict: DeviceEviction,
        cold: ColdStorage,
        prefaulter: Prefaulter,
        lock: asyncio.Lock,
    ) -> None:
        self._ctx = ctx
        self._table = ctx.table
        self._arenas = ctx.arenas
        self._evict = evict
        self._cold = cold
        self._prefaulter = prefaulter
        self._device_lock = lock  # the core's: placement and loads take it in turn

    def note_peak(self) -> None:
        """Record the device pages in use as the peak when it is one."""
        used = self._table.used(DEVICE)
        if used > self._ctx.stats.peak_device_pages:
            self._ctx.stats.peak_device_pages = used

    async def load(
        self, keys: list[PageKey], priority: Priority, deadline: float
    ) -> list[PageKey] | None:
        """Load pages that have a readable lower copy into new device slots and pin them for
        the caller; returns the pages loaded (and pinned), or None when the device has no room
        now. ``keys``: pages absent from the device with a readable lower copy, as the caller
        found them with no suspension since (named again here only when the call waited for
        the device lock). The copies are owned by a task of this class: a cancelled caller
        never frees a slot a copy still writes, and pins that the load took for it are given
        back."""
        table = self._table
        checked = not self._device_lock.locked()  # (a free lock is taken with no suspension)
        async with self._device_lock:
            if not checked:  # it waited for the lock: what the caller saw may have changed
                keys = self._evict.with_lower(cast(list[PageKey], table.absent(keys, DEVICE)))
            if not keys:
                return []
            if not await self._evict.make_room(len(keys), deadline, keys):
                return None
            # each page's source: the first lower tier that holds it readable (one pass per
            # tier over what is left; the make_room above may have waited)
            keys = cast(list[PageKey], table.absent(keys, DEVICE))
            found: dict[str, list[PageKey]] = {}
            rest = keys
            for tier in self._ctx.lower:
                ks = cast(list[PageKey], table.readable(rest, tier))
                if ks:
                    found[tier] = ks
                if len(ks) == len(rest):
                    rest = []
                    break
                here = set(ks)
                rest = [k for k in rest if k not in here]
            if rest:  # no lower copy any more: not loaded here
                gone = set(rest)
                keys = [k for k in keys if k not in gone]
            began = self._begin(keys, found, priority)
        if began is None:
            return None
        new, task = began
        if task is None:  # the copies ran inline and were committed: nothing to wait for,
            try:  # but a turn for the loop (its timers, other tasks), as a copy's completion
                await asyncio.sleep(0)  # gives (a lease's loads ran in a row otherwise: a
            except BaseException:  # 1 ms timer's p99 lateness in loop_scale 3.8 -> 7.3 ms)
                self._unpin(new)  # loaded for a caller who is gone
                raise
            return new
        try:
            await within(deadline, asyncio.shield(task), partial(_in_flight, len(new)))
        except BaseException:
            if task.done():
                if not task.cancelled() and task.exception() is None:
                    self._unpin(new)  # loaded for a caller who is gone
            else:
                task.add_done_callback(partial(self._orphan, new))
            raise
        return new

    def acquire_now(self, keys: Sequence[PageKey], priority: Priority) -> int | None:
        """:meth:`TierSet.acquire_device` with no wait (a step's group, on the cpu backend
        mostly): pins every page of ``keys``, loading what is not resident where that needs
        no wait, and returns the pages loaded; None, with nothing pinned, where it would wait
        (a page in flight or in no tier, more pages than the device holds, a load that cannot
        run here, room only by a write-back): then use ``acquire_device``. The pins, the room
        (clean pages dropped), the slots and the sources' pins are one page-table call
        (:meth:`PageTable.place`), the copy one engine call (:meth:`TransferEngine.copy_now`),
        the commit one more (:meth:`PageTable.land`). Raises what a copy raised; no pin is
        left behind then."""
        todo = list(dict.fromkeys(keys))
        table = self._table
        if len(todo) > table.capacity(DEVICE):
            return None  # (acquire_device raises TierFullError)
        ctx = self._ctx
        if (
            self._device_lock.locked()
            or HOST not in ctx.lower
            or ctx.moves.get(ctx.medium(HOST), ctx.medium(DEVICE)) is not copy_move
        ):  # resident pages only (a load is not this call's to do)
            ready, rest = table.pin_readable(todo, DEVICE)
            if not rest:
                return 0
            if ready:
                self._unpin(cast(list[PageKey], ready))
            return None
        engine, evict = ctx.engine, self._evict
        page_bytes = ctx.spec.page_bytes
        placed = table.place(
            todo,
            DEVICE,
            HOST,
            loadable=lambda n: engine.runs_inline(n * page_bytes),
            clean=cast(Clean, evict.droppable),
            keep=evict.soon,
            keep_order=evict.soon_order,
        )
        if placed is None:
            return None
        new = placed.new
        if not new:
            return 0
        if placed.dropped:
            evict.lower_busy = False
        self.note_peak()
        self._prefaulter.ahead(placed.slots)
        try:  # one copy, here: no handle, no task (the engine is idle: checked by place)
            st = engine.copy_now(
                self._arenas[HOST],
                placed.src_slots,
                self._arenas[DEVICE],
                placed.slots,
                priority=priority,
            )
        except BaseException:
            table.land(placed, DEVICE, HOST, ok=False)
            ctx.progress()
            raise
        if st is None:  # the engine took other work meanwhile: nothing was copied
            table.land(placed, DEVICE, HOST, ok=False)
            ctx.progress()
            return None
        n = len(new)
        ctx.copied("load", "stream host->device", st, n)
        ctx.stats.bytes_h2d += n * ctx.spec.page_bytes
        ctx.stats.loads_from[HOST] += n
        table.land(placed, DEVICE, HOST)
        ctx.stats.loads_landed_at = st.finished_at or time.perf_counter()
        ctx.progress()
        return n

    def reserve_now(self, keys: Sequence[PageKey]) -> list[int] | None:
        """:meth:`TierSet.reserve_device` with no wait: device slots for new pages (WRITING),
        or None, nothing reserved, where the room is not there without a wait (only clean
        pages are dropped for it) or the device lock is held. Raises TierFullError (never
        fits), PageStateError (a key is on the device already)."""
        table = self._table
        if len(keys) > table.capacity(DEVICE):
            raise TierFullError(f"{len(keys)} new pages can never be on the device at once")
        if self._device_lock.locked():
            return None
        if table.present(keys, DEVICE):
            raise PageStateError(f"{len(keys)} new pages: some are already on the device")
        if not self._evict.make_room_now(len(keys), keys):
            return None
        got = self.take_slots(keys)
        return None if got is None else got[1]

    def take_slots(self, keys: Sequence[PageKey]) -> tuple[list[PageKey], list[int]] | None:
        """Device slots for ``keys`` (room made; a load's or new pages'): the pages the policy
        admitted (all, or some) and their slots, WRITING; None when the policy made room of
        its own (undone)."""
        table = self._table
        alloc = table.prepare_store(keys, DEVICE)
        if alloc is None or alloc.evicted:  # room was made under the lock
            if alloc is not None:
                table.complete_store(alloc.keys, DEVICE, ok=False)
            return None
        self.note_peak()
        self._prefaulter.ahead(alloc.slots)
        return cast(list[PageKey], alloc.keys), alloc.slots

    def _begin(
        self, keys: list[PageKey], found: dict[str, list[PageKey]], priority: Priority
    ) -> tuple[list[PageKey], asyncio.Task[None] | None] | None:
        """Allocate device slots for ``keys`` (room made), pin their sources (``found``: tier
        -> its keys) and submit the copies. Returns the pages being loaded and the task that
        ends their copies, or no task when every copy ran inline and the load was committed
        here (its pages pinned for the caller); None when the slots could not be had."""
        table = self._table
        got = self.take_slots(keys)
        if got is None:
            return None
        new, new_slots = got
        if len(new) < len(keys):  # the policy's admission kept some only
            kept = set(new)
            found = {t: [k for k in ks if k in kept] for t, ks in found.items()}
        # sources are pinned now, with no await since they were chosen
        src = {t: (ks, table.prepare_load(ks, t)) for t, ks in found.items() if ks}
        slot_of = dict(zip(new, new_slots))
        # submit now, before any await: the copies run while the caller computes
        work: Work = []
        try:
            for tier, (ks, src_slots) in src.items():
                dst = Target(self._arenas[DEVICE], [slot_of[k] for k in ks], priority)
                batch = Batch(ks, self._arenas[tier], src_slots)
                move = self._ctx.moves.get(self._ctx.medium(tier), self._ctx.medium(DEVICE))
                h = move(self._ctx.engine, dst, batch)
                work.append((tier, len(ks), h))
        except BaseException as exc:  # the copies already submitted finish before the rollback
            return new, asyncio.ensure_future(self._finish(new, src, work, exc))
        if all(h.done() for _, _, h in work):
            done, error = [], None
            for tier, n, h in work:
                if h.exception() is None:
                    done.append((tier, n, h.stats))
                else:
                    error = error or h.exception()
            self._end(new, src, done, error)  # (raises a copy's error, after the rollback)
            return new, None
        return new, asyncio.ensure_future(self._finish(new, src, work, None))

    def _orphan(self, keys: list[PageKey], task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._unpin(keys)

    async def _finish(
        self, keys: list[PageKey], src: Sources, work: Work, error: BaseException | None
    ) -> None:
        """Owns a load to its end, even when the task that asked for it is cancelled: commits
        the pages pinned for the caller (or rolls them back) and wakes the waiters."""
        done: Done = []
        for tier, n, handle in work:
            try:
                st = await job_done(handle)  # the slots are the copy's until it has ended
            except BaseException as exc:  # roll back: the slots are free again
                error = error or exc
            else:
                done.append((tier, n, st))
        self._end(keys, src, done, error)

    def _end(
        self,
        keys: list[PageKey],
        src: Sources,
        done: Done,
        error: BaseException | None,
    ) -> None:
        """A load's copies have ended (``done``: those that succeeded): commit the pages,
        pinned for the caller, or roll them back (``error``, raised then), let go of the
        sources, count, wake the waiters."""
        landed = 0.0
        for tier, n, st in done:
            landed = max(landed, st.finished_at or time.perf_counter())
            if tier == HOST:
                self._ctx.copied("load", "stream host->device", st, n)
                self._ctx.stats.bytes_h2d += n * self._ctx.spec.page_bytes
            self._ctx.stats.loads_from[tier] += n
        for tier, (ks, _) in src.items():
            self._table.complete_load(ks, tier)
        error = self._cold.corrupt(error)  # a cold copy failed its checksum: dropped, typed
        ok = error is None
        self._table.complete_store(keys, DEVICE, ok=ok)
        if ok:
            self._ctx.stats.loads_landed_at = landed
            self._table.prepare_load(keys, DEVICE)  # the caller's pins, taken with the commit
            if self._ctx.top == DEVICE:  # no host tier: the owners pin the leased copy
                self._ctx.owners.pin_owned(keys, DEVICE)
        self._ctx.progress()
        if error is not None:
            raise error

    def _unpin(self, keys: Sequence[PageKey]) -> None:
        self._table.complete_load(list(dict.fromkeys(keys)), DEVICE)
        self._ctx.progress()


def _in_flight(n: int) -> StoreTimeoutError:
    return StoreTimeoutError(f"device tier: {n} pages being loaded did not land in time")
