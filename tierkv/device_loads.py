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
from collections.abc import Sequence
from functools import partial
from typing import cast

from tierkv.core_context import CoreContext
from tierkv.errors import StoreTimeoutError
from tierkv.eviction import DeviceEviction
from tierkv.jobs import job_done, within
from tierkv.keys import PageKey
from tierkv.lower_tiers import ColdStorage
from tierkv.prefault import Prefaulter
from tierkv.runtime import Priority, TransferHandle
from tierkv.tier import Batch, Target
from tierkv.tier_names import DEVICE, HOST

__all__ = ["DeviceLoads"]


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
            alloc = table.prepare_store(keys, DEVICE)
            if alloc is None or alloc.evicted:  # room was made under the lock
                if alloc is not None:
                    table.complete_store(alloc.keys, DEVICE, ok=False)
                return None
            self.note_peak()
            self._prefaulter.ahead(alloc.slots)
            new = cast(list[PageKey], alloc.keys)
            if len(new) < len(keys):  # the policy's admission kept some only
                kept = set(new)
                found = {t: [k for k in ks if k in kept] for t, ks in found.items()}
            # sources are pinned now, with no await since they were chosen
            src = {t: (ks, table.prepare_load(ks, t)) for t, ks in found.items() if ks}
        slot_of = dict(zip(new, alloc.slots))
        # submit now, before any await: the copies run while the caller computes
        work: list[tuple[str, int, TransferHandle]] = []
        try:
            for tier, (ks, src_slots) in src.items():
                dst = Target(self._arenas[DEVICE], [slot_of[k] for k in ks], priority)
                batch = Batch(ks, self._arenas[tier], src_slots)
                move = self._ctx.moves.get(self._ctx.medium(tier), self._ctx.medium(DEVICE))
                h = move(self._ctx.engine, dst, batch)
                work.append((tier, len(ks), h))
        except BaseException as exc:  # the copies already submitted finish before the rollback
            task = asyncio.ensure_future(self._finish(new, src, work, exc))
        else:
            task = asyncio.ensure_future(self._finish(new, src, work, None))
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

    def _orphan(self, keys: list[PageKey], task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._unpin(keys)

    async def _finish(
        self,
        keys: list[PageKey],
        src: dict[str, tuple[list[PageKey], list[int]]],
        work: list[tuple[str, int, TransferHandle]],
        error: BaseException | None,
    ) -> None:
        """Owns a load to its end, even when the task that asked for it is cancelled: commits
        the pages pinned for the caller (or rolls them back) and wakes the waiters."""
        landed = 0.0
        for tier, n, handle in work:
            try:
                res = await job_done(handle)  # the slots are the copy's until it has ended
            except BaseException as exc:  # roll back: the slots are free again
                error = error or exc
                continue
            landed = max(landed, handle.stats.finished_at or time.perf_counter())
            if tier == HOST:
                self._ctx.copied("load", "stream host->device", res, n)
                self._ctx.stats.bytes_h2d += n * self._ctx.spec.page_bytes
            self._ctx.stats.loads_from[tier] += n
        for tier, (ks, _) in src.items():
            self._table.complete_load(ks, tier)
        error = self._cold.corrupt(error)  # a cold copy failed its checksum: dropped, typed
        self._table.complete_store(keys, DEVICE, ok=error is None)
        if error is None:
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
