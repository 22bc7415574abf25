"""Device-tier eviction: victims by policy, written back when dirty, and write-behind.

A device page leaves only after its bytes are safe below: when it is dirty (newer than its lower
copies) or has no lower copy, it is copied to the host first (``WRITEBACK`` priority, after the
compute that wrote it). Write-behind copies pages a lease wrote as soon as the lease ends, so
that a later eviction is a drop with no wait. Part of :class:`tierkv.tiers.TierSet`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, cast

from tierkv.errors import TierFullError
from tierkv.page_table import PageTable
from tierkv.runtime import Arena, Priority, TransferEngine
from tierkv.spec import KVSpec
from tierkv.tier_stats import COLD, DEVICE, HOST, Key, TierStats
from tierkv.timeline import Timeline


class DeviceEviction:
    """Mixin of :class:`~tierkv.tiers.TierSet`: making room on the device."""

    spec: KVSpec
    engine: TransferEngine
    arenas: dict[str, Arena]
    table: PageTable
    lower: list[str]
    dirty: dict[Key, int]
    write_behind_pinned: int
    soon: frozenset[Key]
    soon_order: tuple[Key, ...]
    owners: dict[Key, int]
    stats: TierStats
    timeline: Timeline
    _gen: int
    _has_lower: Callable[[Key], bool]
    forget_in: Callable[[str, Sequence[Key]], None]
    host_left: Callable[[Sequence[Hashable]], None]

    if TYPE_CHECKING:  # provided by ColdStorage and TierSet

        def signal_progress(self) -> None: ...

        async def _make_room_host(self, n: int) -> None: ...

        def pin_owner(self, keys: Sequence[Key], tiers: Sequence[str]) -> None: ...

        def unpin_owner(self, key: Key, tier: str) -> None: ...

    async def _make_room(self, n: int) -> bool:
        """Free ``n`` device slots: victims by policy, written back when needed, then dropped.
        Returns False (nothing changed) when too few pages are evictable now: the caller waits
        for a change outside the device lock, so a lease that holds pins can still append."""
        table = self.table
        free = table.capacity(DEVICE) - table.used(DEVICE)
        if free >= n:
            return True
        # all or nothing: a partial pick put back would still churn the policy's queues
        victims = cast(
            list[tuple[Key, int]],
            table.prepare_evict(
                DEVICE, n - free, exact=True, keep=self.soon, keep_order=self.soon_order
            ),
        )
        if not victims:
            return False
        keys = [k for k, _ in victims]
        wb = [(k, s) for k, s in victims if k in self.dirty or not self._has_lower(k)]
        if not wb:  # clean pages with a lower copy: drop them, no wait
            table.complete_evict(keys, DEVICE, ok=True)
            return True
        task = asyncio.ensure_future(self._write_back(wb))
        try:
            await asyncio.shield(task)
        except BaseException:
            if not task.done():  # cancelled caller: the task finishes the eviction on its own
                task.add_done_callback(lambda t: self._end_evict(keys, t))
                raise
            self._end_evict(keys, task)
            raise
        self._end_evict(keys, task)
        return True

    def _end_evict(self, keys: list[Key], task: asyncio.Task[None]) -> None:
        ok = not task.cancelled() and task.exception() is None
        self.table.complete_evict(keys, DEVICE, ok=ok)
        if ok:
            self._clean(keys)
        self.signal_progress()

    async def _write_back(self, victims: list[tuple[Key, int]]) -> None:
        if not victims:
            return
        table = self.table
        keys = [k for k, _ in victims]
        stale_cold = [k for k in keys if COLD in self.lower and table.present([k], COLD)]
        await self._make_room_host(len(keys))
        alloc = table.prepare_store(keys, HOST)
        if alloc is None:
            raise TierFullError(
                f"host tier full: {len(keys)} pages to write back, every host page is owned"
            )
        self.host_left(alloc.evicted)  # only when room was taken since _make_room_host
        dst_of = dict(zip(alloc.keys, alloc.slots))
        for k in alloc.present:  # a stale host copy: overwrite it in place
            dst_of[k] = table.slot(k, HOST)
        written = self.engine.backend.compute_event()  # the copy waits for the compute
        handle = self.engine.submit(
            self.arenas[DEVICE],
            [s for _, s in victims],
            self.arenas[HOST],
            [dst_of[k] for k in keys],
            priority=Priority.WRITEBACK,
            after=[written] if written is not None else [],
        )
        try:
            st = await handle.wait()
        except BaseException:
            if not handle.done():
                await asyncio.shield(asyncio.ensure_future(handle.wait()))
            table.complete_store(alloc.keys, HOST, ok=False)
            raise
        table.complete_store(alloc.keys, HOST)
        self.stats.copy_s += st.copy_s
        self.timeline.span(
            "write back",
            "stream device->host",
            st.started_at,
            st.finished_at,
            pages=len(keys),
            queue_wait_s=st.queue_wait_s,
        )
        self.stats.bytes_d2h += len(keys) * self.spec.page_bytes
        self.stats.pages_written_back += len(keys)
        self.pin_owner([k for k in alloc.keys if k in self.owners], [HOST])
        for k in stale_cold:  # the cold copy is older than the one just written
            self.unpin_owner(k, COLD)
            self.forget_in(COLD, [k])

    def mark_dirty(self, keys: Sequence[Key]) -> None:
        """Device copies of ``keys`` were written: newer than any lower copy."""
        for k in keys:
            self._gen += 1
            self.dirty[k] = self._gen

    def _clean(self, keys: Sequence[Key], gens: dict[Key, int] | None = None) -> None:
        for k in keys:
            if gens is None or self.dirty.get(k) == gens.get(k):
                self.dirty.pop(k, None)

    async def write_behind(self, keys: Sequence[Key]) -> int:
        """Copy dirty, unpinned device pages down now (write-behind), so that evicting them
        later costs no wait. Returns the pages written. The device pages stay pinned (never
        evicted, never renamed) until the copy has ended, even when the caller is cancelled."""
        table = self.table
        pick = [k for k in dict.fromkeys(keys) if k in self.dirty and table.lookup([k], DEVICE)]
        if not pick:
            return 0
        slots = table.prepare_load(pick, DEVICE)  # no eviction while the copy reads them
        self.write_behind_pinned += len(pick)
        gens = {k: self.dirty[k] for k in pick}
        task = asyncio.ensure_future(self._write_back(list(zip(pick, slots))))
        task.add_done_callback(lambda t: self._end_write_behind(pick, gens, t))
        await asyncio.shield(task)
        return len(pick)

    def _end_write_behind(
        self, keys: list[Key], gens: dict[Key, int], task: asyncio.Task[None]
    ) -> None:
        self.table.complete_load(keys, DEVICE)
        self.write_behind_pinned -= len(keys)
        if not task.cancelled() and task.exception() is None:
            self._clean(keys, gens)  # a page written again meanwhile stays dirty
        self.signal_progress()
