"""Device-tier eviction: victims by policy, written back when dirty, and write-behind.

A device page leaves only after its bytes are safe below: when it is dirty (newer than its lower
copies) or has no lower copy, it is copied to the host first (``WRITEBACK`` priority, after the
compute that wrote it). Write-behind copies pages a lease wrote as soon as the lease ends, so
that a later eviction is a drop with no wait. The write-back is the move
registered from the device to the host (``moves.get(DEVICE, HOST)``). The dirty set and the
announced pages follow a rename (:meth:`DeviceEviction.rename`, a listener of
:class:`~tierkv.ownership.Ownership`). A collaborator of the tier core
(:class:`tierkv.tiers.TierSet`), built from its :class:`~tierkv.core_context.CoreContext`: it
changes page state only through the page table, and tells the core of every change by
``progress``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from functools import partial
from typing import cast

from tierkv.core_context import CoreContext
from tierkv.errors import QuotaExceededError, StoreTimeoutError, TierFullError
from tierkv.jobs import job_done, when_done, within
from tierkv.keys import PageKey
from tierkv.lower_tiers import ColdStorage
from tierkv.page_table import PageState
from tierkv.runtime import Priority
from tierkv.tier import Batch, Target
from tierkv.tier_names import COLD, DEVICE, HOST

__all__ = ["DeviceEviction"]


class DeviceEviction:
    """Making room on the device of one tier core, and the dirty pages it must write back."""

    def __init__(self, ctx: CoreContext, cold: ColdStorage) -> None:
        self._ctx = ctx
        self._table = ctx.table
        self._arenas = ctx.arenas
        self._engine = ctx.engine
        self._lower = list(ctx.lower)
        self._host = cold
        self.dirty: dict[PageKey, int] = {}  # device copy newer than the lower ones -> generation
        self._gen = 0
        self.write_behind_pinned = 0  # device pages pinned by write-behind copies (not leases)
        self.soon: frozenset[PageKey] = frozenset()  # pages of announced steps
        self.soon_order: tuple[PageKey, ...] = ()  # the same, soonest needed first
        # the last eviction put victims back because their host copies were busy (copies
        # that end on their own): a caller short of room waits for a change, not fails
        self.lower_busy = False

    def announce(self, keys: Iterable[PageKey]) -> None:
        """Pages the coming steps read, soonest needed first: evictions take them only when no
        other page can go, the last needed first (the schedule outranks the policy)."""
        order = tuple(keys)
        if order == self.soon_order:  # (a decode step announces what the one before did:
            return  # the same order keeps its index of places, OrderIndex, unbuilt again)
        self.soon_order = order
        self.soon = frozenset(order)

    def rename(self, old: Sequence[PageKey], new: Sequence[PageKey]) -> None:
        """Pages were renamed (:meth:`tierkv.ownership.Ownership.rekey`): the dirty set and
        the announced pages follow."""
        dirty, soon = self.dirty, self.soon
        moved = False
        for o, n in zip(old, new):
            if o in dirty:
                dirty[n] = dirty.pop(o)
            moved = moved or o in soon
        if moved:
            to = dict(zip(old, new))
            self.announce(to.get(k, k) for k in self.soon_order)

    def with_lower(self, keys: Sequence[PageKey]) -> list[PageKey]:
        """The keys (in order) that some lower tier holds readable."""
        return cast(list[PageKey], self._table.readable(keys, self._lower)) if keys else []

    async def make_room(self, n: int, deadline: float, for_keys: Sequence[PageKey] = ()) -> bool:
        """Free ``n`` device slots: victims by policy, written back when needed, then dropped.
        Returns False when too few pages are evictable now (nothing changed) or some victims'
        host copies were busy (those stay; :attr:`lower_busy`): the caller waits for a change
        outside the device lock, so a lease that holds pins can still append. ``for_keys``:
        the pages the room is for (their tenant's quotas; see :mod:`tierkv.tenants`).
        Raises StoreTimeoutError when a write-back does not end by ``deadline`` (loop time; the
        eviction then ends on its own when the copy does)."""
        table = self._table
        self.lower_busy = False
        free = table.capacity(DEVICE) - table.used(DEVICE)
        if free >= n:
            return True
        if HOST not in self._lower:  # no host tier: its victims leave as the host's do
            await self._host.make_room(n, self.soon, self.soon_order)
            return table.capacity(DEVICE) - table.used(DEVICE) >= n
        # victims put back because their host copies were busy (a copy reads or writes them:
        # pinned only for a while) are taken last on the next pick, so that clean pages go
        # now instead of a wait for those copies (which may outlast the caller's deadline)
        busy: frozenset[PageKey] = frozenset()
        while free < n:
            # all or nothing: a partial pick put back would still churn the policy's queues
            keep = self.soon | busy if busy else self.soon  # (no copy of the schedule)
            victims = self._pick(n - free, keep, for_keys)
            if not victims:
                return False
            keys = [k for k, _ in victims]
            safe = set(self.with_lower(keys))
            wb = [(k, s) for k, s in victims if k in self.dirty or k not in safe]
            if not wb:  # clean pages with a lower copy: drop them, no wait
                table.complete_evict(keys, DEVICE, ok=True)
                free = table.capacity(DEVICE) - table.used(DEVICE)
                continue
            task = asyncio.ensure_future(self._write_back(wb))
            try:
                await within(deadline, asyncio.shield(task), partial(_late, len(wb)))
            except BaseException:
                if not task.done():  # cancelled caller: the task ends the eviction on its own
                    task.add_done_callback(partial(self._end_evict, keys, wb))
                    raise
                self._end_evict(keys, wb, task)
                raise
            back = self._end_evict(keys, wb, task)
            if back and (not self.lower_busy or busy.issuperset(back)):
                return False  # failed, or only busy victims are left: wait for a change
            busy |= frozenset(back)
            free = table.capacity(DEVICE) - table.used(DEVICE)
        return True

    def make_room_now(self, n: int, for_keys: Sequence[PageKey] = ()) -> bool:
        """:meth:`make_room` with no wait: only clean victims with a lower copy go (dropped).
        Returns False, with no page gone, when too few pages are evictable now or a victim
        would need a write-back (the victims picked are put back)."""
        table = self._table
        free = table.capacity(DEVICE) - table.used(DEVICE)
        if free >= n:
            return True
        if HOST not in self._lower:
            return False
        victims = self._pick(n - free, self.soon, for_keys)
        if not victims:
            return False
        keys = [k for k, _ in victims]
        if not self.droppable(keys):
            table.complete_evict(keys, DEVICE, ok=False)  # a write-back: make_room's to do
            return False
        table.complete_evict(keys, DEVICE, ok=True)
        self.lower_busy = False
        return True

    def droppable(self, keys: Sequence[PageKey]) -> bool:
        """Whether device pages can leave with no write-back: none is dirty and each has a
        readable lower copy."""
        dirty = self.dirty
        return not any(k in dirty for k in keys) and len(self.with_lower(keys)) == len(keys)

    def _pick(
        self, n: int, keep: frozenset[PageKey], for_keys: Sequence[PageKey]
    ) -> list[tuple[PageKey, int]]:
        """``n`` device victims (key, slot) by policy, all or none, the announced pages taken
        last (the one read last first), ``keep`` only when no other page can go."""
        return cast(
            list[tuple[PageKey, int]],
            self._table.prepare_evict(
                DEVICE, n, exact=True, keep=keep, keep_order=self.soon_order, for_keys=for_keys
            ),
        )

    def _end_evict(
        self, keys: list[PageKey], wb: list[tuple[PageKey, int]], task: asyncio.Task[list[PageKey]]
    ) -> list[PageKey]:
        """End an eviction: the victims written back (or clean with a lower copy) leave, the
        rest are put back (a failed write-back, or a host copy busy that could not be
        overwritten: see :meth:`_write_back`). Returns those put back."""
        ok = not task.cancelled() and task.exception() is None
        written = set(task.result()) if ok else set()
        back = [k for k, _ in wb if k not in written]
        gone = [k for k in keys if k not in set(back)] if back else keys
        self.lower_busy = ok and bool(back)
        if back:
            self._table.complete_evict(back, DEVICE, ok=False)
        if gone:
            self._table.complete_evict(gone, DEVICE, ok=True)
            self.clean(gone)
        self._ctx.progress()
        return back

    async def _write_back(self, victims: list[tuple[PageKey, int]]) -> list[PageKey]:
        """Copy device pages (key, device slot) to the host; returns the keys written.

        A stale host copy is overwritten in place only when it is idle (readable, pinned by
        nothing but its owners), and it is pinned for the copy: a host copy that another copy
        reads or that is leaving (compressed to cold, offered to the remote tier, exported,
        written by another write-back) is never written, since the copy reading it would then
        store its old bytes as current, or its slot would be freed under this write; such
        pages are not written (their device copies stay dirty). Cold copies are older than what
        was written: dropped once it has landed."""
        if not victims:
            return []
        table, owners = self._table, self._ctx.owners
        keys = [k for k, _ in victims]
        present = cast(list[PageKey], table.present(keys, HOST))
        if present:
            idle = {
                k
                for k in present
                if table.state(k, HOST) == PageState.READABLE
                and table.pins(k, HOST) == (1 if owners.holds_pin(k, HOST) else 0)
            }
            busy = set(present) - idle
            victims = [(k, s) for k, s in victims if k not in busy]
            keys = [k for k, _ in victims]
            present = [k for k in present if k in idle]
            if not victims:
                return []
            table.prepare_load(present, HOST)  # held for the copy: never a victim meanwhile
        try:
            await self._host.make_room(len(keys) - len(present), for_keys=keys)
            return await self._copy_down(victims, present)
        finally:
            if present:
                table.complete_load(present, HOST)
                self._ctx.progress()

    async def _copy_down(
        self, victims: list[tuple[PageKey, int]], present: list[PageKey]
    ) -> list[PageKey]:
        """The copy of :meth:`_write_back`, its host copies in ``present`` pinned."""
        table = self._table
        keys = [k for k, _ in victims]
        alloc = table.prepare_store(keys, HOST)
        if alloc is None and table.quota_blocked(HOST):
            who = table.quota_refused(HOST)
            raise QuotaExceededError(
                f"host tier: no room to write {len(keys)} pages back "
                f"{'' if who is None else f'of tenant {who!r} '}without taking pages of a "
                "tenant at its reservation",
                tenant=who,
            )
        if alloc is None:
            raise TierFullError(
                f"host tier full: {len(keys)} pages to write back, every host page is owned"
            )
        self._ctx.departures.left(alloc.evicted)  # only when room was taken since make_room
        late = set(alloc.present) - set(present)
        if late:  # host copies that came while room was made (another write-back's): not ours
            victims = [(k, s) for k, s in victims if k not in late]
            keys = [k for k, _ in victims]
            if not keys:
                return []
        dst_of = dict(zip(alloc.keys, alloc.slots))
        for k in present:  # a stale host copy (idle, pinned above): overwritten in place
            dst_of[k] = table.slot(k, HOST)
        written = self._engine.backend.compute_event()  # the copy waits for the compute
        target = Target(
            self._arenas[HOST],
            [dst_of[k] for k in keys],
            Priority.WRITEBACK,
            (written,) if written is not None else (),
        )
        batch = Batch(keys, self._arenas[DEVICE], [s for _, s in victims])
        move = self._ctx.moves.get(self._ctx.medium(DEVICE), self._ctx.medium(HOST))
        handle = move(self._engine, target, batch)
        try:
            st = await job_done(handle)  # the slots are the copy's until it has ended
        except BaseException:
            if not handle.done():  # cancelled: the host slots are freed once the copy ended
                handle.cancel()
                when_done(handle, lambda: table.complete_store(alloc.keys, HOST, ok=False))
                raise
            table.complete_store(alloc.keys, HOST, ok=False)
            raise
        table.complete_store(alloc.keys, HOST)
        self._ctx.copied("write back", "stream device->host", st, len(keys))
        self._ctx.stats.bytes_d2h += len(keys) * self._ctx.spec.page_bytes
        self._ctx.stats.pages_written_back += len(keys)
        self._ctx.owners.pin_owned(cast(list[PageKey], alloc.keys), HOST)
        if COLD in self._lower:  # cold copies, whenever they came, are older than this one
            for k in cast(list[PageKey], table.present(keys, COLD)):
                self._ctx.owners.unpin(k, COLD)
                self._host.forget_in(COLD, [k])
        return keys

    def mark_dirty(self, keys: Sequence[PageKey]) -> None:
        """Device copies of ``keys`` were written: newer than any lower copy (nothing to write
        back without a host tier: the owners pin the one exact copy, on the device)."""
        if HOST not in self._lower:
            return
        for k in keys:
            self._gen += 1
            self.dirty[k] = self._gen

    def clean(self, keys: Sequence[PageKey], gens: dict[PageKey, int] | None = None) -> None:
        """The device copies of ``keys`` are safe below (those of generation ``gens`` only)."""
        for k in keys:
            if gens is None or self.dirty.get(k) == gens.get(k):
                self.dirty.pop(k, None)

    async def write_behind(self, keys: Sequence[PageKey]) -> int:
        """Copy dirty, unpinned device pages down now (write-behind), so that evicting them
        later costs no wait. Returns the pages written. The device pages stay pinned (never
        evicted, never renamed) until the copy has ended, even when the caller is cancelled."""
        table = self._table
        dirty = self.dirty
        pick = cast(
            list[PageKey], table.readable([k for k in dict.fromkeys(keys) if k in dirty], DEVICE)
        )
        if not pick:
            return 0
        slots = table.prepare_load(pick, DEVICE)  # no eviction while the copy reads them
        self.write_behind_pinned += len(pick)
        gens = {k: self.dirty[k] for k in pick}
        task = asyncio.ensure_future(self._write_back(list(zip(pick, slots))))
        task.add_done_callback(lambda t: self._end_write_behind(pick, gens, t))
        return len(await asyncio.shield(task))  # (pages whose host copy was busy: not written)

    def _end_write_behind(
        self, keys: list[PageKey], gens: dict[PageKey, int], task: asyncio.Task[list[PageKey]]
    ) -> None:
        self._table.complete_load(keys, DEVICE)
        self.write_behind_pinned -= len(keys)
        if not task.cancelled() and task.exception() is None:
            self.clean(task.result(), gens)  # a page written again meanwhile stays dirty
        self._ctx.progress()


def _late(n: int) -> StoreTimeoutError:
    return StoreTimeoutError(f"device tier: writing {n} pages back did not end in time")
