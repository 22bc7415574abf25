"""The tiers of a store and the moves between them.

Three tiers, each an arena of fixed-size slots plus its column of the page table::

    device  (GPU memory; host memory on the cpu backend)     slots of page_bytes  <- attention
       |  ^  evict: write back if dirty or no lower copy      |  load (demand / prefetch)
       v  |                                                   |
    host    (pinned host RAM)                                 slots of page_bytes
       |  ^  full or idle: compress                           |  load: decode into device slot
       v  |                                                   |
    cold    (host RAM, compressed by a codec)                 slots of encoded_bytes  -> dropped

Rules that keep KV safe:

* a page that a live sequence owns always has a copy somewhere: its lower copies are pinned while
  it is owned, and a device page is written back before it leaves when it is dirty (newer than
  its lower copies) or has no lower copy;
* a slot that a transfer reads or writes is never reused before the transfer has finished: the
  pages are WRITING / MOVING / pinned in the page table until a task owned by this class (not the
  caller, who may be cancelled) has seen the copy complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from typing import Any, cast

import torch

from tierkv.codecs import Codec
from tierkv.cold import ColdStorage
from tierkv.errors import (
    PageStateError,
    StoreTimeoutError,
    TierFullError,
    TierKVError,
    UnknownPageError,
)
from tierkv.eviction import DeviceEviction
from tierkv.page_table import PageState, PageTable
from tierkv.runtime import Arena, Backend, Priority, TransferEngine
from tierkv.spec import KVSpec
from tierkv.tier_stats import COLD, DEVICE, HOST, Key, TierStats
from tierkv.timeline import Timeline
from tierkv.waits import Changes


class TierSet(DeviceEviction, ColdStorage):
    """Arenas, page table and moves of one store. Used from one event loop."""

    def __init__(
        self,
        spec: KVSpec,
        backend: Backend,
        engine: TransferEngine,
        *,
        device_pages: int,
        host_pages: int,
        cold_pages: int,
        codec: Codec | None,
        policy: str,
        timeline: Timeline | None = None,
    ) -> None:
        self.spec = spec
        self.timeline = timeline if timeline is not None else Timeline()
        self.engine = engine
        self.codec = codec if cold_pages > 0 else None
        self.arenas: dict[str, Arena] = {
            DEVICE: backend.create_arena(DEVICE, spec.page_bytes, device_pages),
            HOST: backend.create_arena(HOST, spec.page_bytes, host_pages, kind="pinned"),
        }
        tiers = {DEVICE: device_pages, HOST: host_pages}
        if self.codec is not None:
            self.arenas[COLD] = backend.create_arena(
                COLD, self.codec.encoded_bytes(spec), cold_pages, kind="pinned"
            )
            tiers[COLD] = cold_pages
        # every device slot as a page [2, H, T, D] in the KV dtype, without copies
        raw = self.arenas[DEVICE].tensor[:, : 2 * spec.kv_bytes]
        self._pages = raw.view(spec.dtype).view(device_pages, *spec.page_shape)
        for arena in self.arenas.values():  # the page table hands out slots, not the arena
            arena.allocate(arena.num_slots)
        self.table = PageTable(tiers, policy, record_events=False)  # the store keeps counters
        self.lower = [t for t in (HOST, COLD) if t in tiers]
        self.dirty: dict[Key, int] = {}  # device copy newer than the lower ones -> generation
        self._gen = 0
        self.owners: dict[Key, int] = {}  # live sequences holding each page
        # lower tiers where owners pin a copy, as bits (_tier_bit): a dict of ints is one the
        # cyclic garbage collector never walks (a set per owned page made its pauses long)
        self.owner_pins: dict[Key, int] = {}
        self._tier_bit = {t: 1 << i for i, t in enumerate(self.lower)}
        self.stats = TierStats()
        self._device_lock = asyncio.Lock()
        # every change that may free device room or land a page in flight wakes the waiters:
        # in flight is the page state (WRITING / MOVING) alone, pins the page table's alone
        self.changes = Changes()
        self.doomed: set[Key] = set()  # released private pages still busy: removed when idle
        self.soon: frozenset[Key] = frozenset()  # pages of announced steps (see announce)
        self.soon_order: tuple[Key, ...] = ()  # the same, soonest needed first
        self.write_behind_pinned = 0  # device pages pinned by write-behind copies (not leases)
        # pages leaving the host tier: listeners (a page server's announcements) and the
        # remote tier's offer of exact bytes about to be compressed or dropped
        self.host_listeners: list[Callable[[list[Key]], None]] = []
        self.remote_offer: Callable[[list[tuple[Key, int]]], Awaitable[None]] | None = None

    def announce(self, keys: Iterable[Key]) -> None:
        """Pages the coming steps read, soonest needed first (the server's schedule): device
        evictions take them only when no other page can go, the last needed first, whatever
        the policy ranks (the schedule outranks it)."""
        self.soon_order = tuple(keys)
        self.soon = frozenset(self.soon_order)

    # -- where pages are ---------------------------------------------------------------
    def holds(self, key: Key) -> bool:
        """True when some tier holds ``key`` (readable, or in flight to readable)."""
        return bool(self.table.tiers_of(key))

    def device_slot(self, key: Key) -> int:
        """Device slot of a resident page. Raises UnknownPageError."""
        return self.table.slot(key, DEVICE)

    def page(self, slot: int) -> torch.Tensor:
        """A device slot viewed as a page ``[2, H, T, D]`` (zero-copy)."""
        return self._pages[slot]

    def zero_device(self, slots: Sequence[int]) -> None:
        """Zero device slots (new pages start clean, whatever the slot held before)."""
        arena = self.arenas[DEVICE]
        for s in slots:  # a handful of pages: a memset each (index_fill_ scans the whole arena)
            arena.slot_view(s).zero_()

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """Device slots gathered into ``[n, 2, H, T, D]`` (one copy)."""
        idx = torch.tensor(slots, dtype=torch.long, device=self._pages.device)
        return self._pages.index_select(0, idx)

    # -- ownership ---------------------------------------------------------------------
    def own(self, keys: Sequence[Key]) -> None:
        """A live sequence holds ``keys``: pin their lower copies so none is dropped."""
        for k in keys:
            n = self.owners.get(k, 0)
            self.owners[k] = n + 1
            self.doomed.discard(k)
            if n == 0:
                self.pin_owner([k], [t for t in self.lower if self.table.lookup([k], t)])

    def disown(self, keys: Sequence[Key]) -> None:
        """Drop one owner of each key; unowned pages become evictable cache."""
        for k in keys:
            n = self.owners.get(k, 0)
            if n <= 1:
                self.owners.pop(k, None)
                held = self.owner_pins.get(k, 0)
                for t, bit in self._tier_bit.items():
                    if held & bit:
                        self.unpin_owner(k, t)
            else:
                self.owners[k] = n - 1

    def pin_owner(self, keys: Sequence[Key], tiers: Sequence[str]) -> None:
        """Pin the copies of owned pages in ``tiers`` on behalf of their owners (recorded, so
        that only these pins, never a copy's transient pin, are dropped with the owner)."""
        for t in tiers:
            if keys:
                self.table.prepare_load(keys, t)
                pins, bit = self.owner_pins, self._tier_bit[t]
                for k in keys:
                    pins[k] = pins.get(k, 0) | bit

    def owner_pinned(self, key: Key, tier: str) -> bool:
        """Whether the owners of ``key`` pin its copy in ``tier``."""
        return bool(self.owner_pins.get(key, 0) & self._tier_bit.get(tier, 0))

    def unpin_owner(self, key: Key, tier: str) -> None:
        """Drop the owner's pin on ``key``'s copy in ``tier`` (if it holds one)."""
        held, bit = self.owner_pins.get(key, 0), self._tier_bit.get(tier, 0)
        if not held & bit:
            return
        if held == bit:
            del self.owner_pins[key]
        else:
            self.owner_pins[key] = held & ~bit
        if self.table.present([key], tier):
            self.table.complete_load([key], tier)

    def forget(self, keys: Sequence[Key]) -> None:
        """Remove released private pages from every tier. Copies busy now (pinned by a copy or a
        lease, or in flight) are *doomed*: removed as soon as they are idle (see :meth:`reap`),
        so a release during a write-behind copy or inside a lease leaks nothing."""
        for k in keys:
            self.dirty.pop(k, None)
        self.doomed.update(k for k in keys if k not in self.owners)
        self.reap()

    def reap(self) -> None:
        """Remove the doomed pages that are idle now (readable, unpinned) from every tier."""
        if not self.doomed:
            return
        table = self.table
        for t in table.tier_names:
            here = [
                k
                for k in table.present(self.doomed, t)
                if table.state(k, t) == PageState.READABLE and not table.pins(k, t)
            ]
            if here:
                table.remove(here, t)
                if t == HOST:
                    self.host_left(here)
        self.doomed = {k for k in self.doomed if table.tiers_of(k)}

    def idle(self, key: Key) -> bool:
        """True when no copy of ``key`` is in flight or pinned by anything but its owners."""
        table = self.table
        for t in table.tiers_of(key):
            if table.state(key, t) != PageState.READABLE:
                return False
            if table.pins(key, t) != (1 if self.owner_pinned(key, t) else 0):
                return False
        return True

    def rekey(self, old: Sequence[Key], new: Sequence[Key]) -> bool:
        """Rename pages everywhere (private -> content). False (nothing changed) when a new key
        is in some tier (in any state) or an old page is busy: in flight (a load, a write-back,
        a compression) or pinned by a copy or a lease. So a rename never races an eviction:
        the copy that moves a page completes under the name it started with."""
        table = self.table
        if any(table.tiers_of(k) for k in new) or not all(self.idle(k) for k in old):
            return False
        if any(k in self.doomed for k in old):
            return False
        for t in table.tier_names:
            pairs = [(o, n) for o, n in zip(old, new) if table.present([o], t)]
            if pairs:
                table.rekey([o for o, _ in pairs], [n for _, n in pairs], t)
        for o, n in zip(old, new):
            if o in self.dirty:
                self.dirty[n] = self.dirty.pop(o)
            if o in self.owners:
                self.owners[n] = self.owners.pop(o)
            if o in self.owner_pins:
                self.owner_pins[n] = self.owner_pins.pop(o)
        return True

    # -- waiting ---------------------------------------------------------------------------
    def signal_progress(self) -> None:
        """Device state changed (a copy ended, a pin went, a page left): reap the doomed pages
        that became idle and wake whoever waits for room or for a page in flight."""
        self.reap()
        self.changes.notify()

    def deadline(self, timeout: float | None = None) -> float:
        """Loop time ``timeout`` seconds from now (default: the engine's timeout)."""
        return self.changes.deadline(self.engine.timeout if timeout is None else timeout)

    def _could_free(self, mine: int) -> bool:
        """Whether device pages pinned or in flight for others than the caller (who holds
        ``mine`` of them pinned) may go, so that waiting for room can succeed."""
        t = self.table
        return t.used(DEVICE) - t.evictable(DEVICE) > mine

    def _copies_in_flight(self) -> bool:
        """Whether device pages are held by copies that end on their own: write-behind
        reads, loads (WRITING) or write-backs (MOVING), as opposed to leases' pins."""
        if self.write_behind_pinned:
            return True
        t = self.table
        return any(t.state(k, DEVICE) != PageState.READABLE for k in t.keys(DEVICE))

    def full_error(self, n: int, waited: float | None = None) -> TierFullError:
        """The error of a device with no room for ``n`` pages (after ``waited`` seconds)."""
        t = self.table
        free = t.capacity(DEVICE) - t.used(DEVICE)
        pinned = t.used(DEVICE) - t.evictable(DEVICE)
        after = f" after waiting {waited:.3g} s" if waited is not None else ""
        return TierFullError(
            f"device tier full{after}: {n} pages needed, {free} free, {pinned} pinned or in "
            f"flight (capacity {t.capacity(DEVICE)} pages of {self.spec.page_bytes} B)"
        )

    def ensure_fits(self, n: int) -> None:
        """Raise TierFullError at once when ``n`` pages can never be resident together."""
        cap = self.table.capacity(DEVICE)
        if n > cap:
            raise TierFullError(
                f"device tier: {n} pages can never be resident at once (capacity {cap} pages "
                f"of {self.spec.page_bytes} B)"
            )

    # -- device allocation ---------------------------------------------------------------
    async def allocate_device(
        self, keys: Sequence[Key], *, mine: int = 0, timeout: float | None = None
    ) -> list[int]:
        """Reserve device slots for new pages (WRITING) and return them; the caller writes the
        bytes and calls :meth:`commit_device` (or :meth:`abort_device`). When other holders'
        pins fill the device it waits for them to go, at most ``timeout`` seconds (default the
        engine's); ``mine``: device pages the caller itself holds pinned (they never go).

        Raises:
            TierFullError: the pages never fit, or no room came before the deadline.
            PageStateError: a key is already on the device (nothing is reserved).
        """
        self.ensure_fits(len(keys))
        deadline = self.deadline(timeout)
        while True:
            async with self._device_lock:
                if self.table.present(keys, DEVICE):
                    raise PageStateError(f"{len(keys)} new pages: some are already on the device")
                if await self._make_room(len(keys)):
                    alloc = self.table.prepare_store(keys, DEVICE)
                    if alloc is not None and not alloc.evicted:
                        self._note_peak()
                        return alloc.slots
                    if alloc is not None:  # the policy made room by itself: undo, use ours
                        self.table.complete_store(alloc.keys, DEVICE, ok=False)
            if not self._could_free(mine):
                raise self.full_error(len(keys))
            waited = self.engine.timeout if timeout is None else timeout
            await self.changes.wait(deadline, lambda: self.full_error(len(keys), waited))  # noqa: B023

    def commit_device(self, keys: Sequence[Key]) -> None:
        """New device pages are written: readable, dirty (no lower copy yet)."""
        self.table.complete_store(keys, DEVICE)
        self.mark_dirty(keys)

    def abort_device(self, keys: Sequence[Key], *, pinned: bool, owned: bool) -> None:
        """Undo new pages reserved by :meth:`allocate_device` (WRITING), or committed and then
        ``pinned`` (:meth:`pin_device`) and ``owned`` (:meth:`own`): a failed append leaves no
        page, pin or owner behind."""
        if not keys:
            return
        table = self.table
        if owned:
            self.disown(keys)
        if pinned:
            table.complete_load(keys, DEVICE)
        writing = [k for k in keys if table.state(k, DEVICE) == PageState.WRITING]
        if writing:
            table.complete_store(writing, DEVICE, ok=False)
        rest = [k for k in keys if k not in set(writing)]
        for k in keys:
            self.dirty.pop(k, None)
        if rest:
            table.remove(rest, DEVICE)
        self.signal_progress()

    def pin_device(self, keys: Sequence[Key]) -> None:
        """Pin readable device pages (unpin with :meth:`release_device`)."""
        self.table.prepare_load(keys, DEVICE)

    async def acquire_device(
        self,
        keys: Sequence[Key],
        priority: Priority,
        *,
        wait_room: bool = True,
        timeout: float | None = None,
    ) -> int:
        """Make every page of ``keys`` readable on the device, loading what is not, and pin
        them there (release with :meth:`release_device`). Returns how many pages this call had
        to load or wait for (0 when all were resident: no wait).

        Pages in flight (being loaded or written back) are waited for; when other holders'
        pins leave no room, it waits for them to go (``wait_room=False``, as a prefetch: waits
        only for copies in flight, fails at once when leases' pins fill the device). Every wait
        is woken by a change and bounded by ``timeout`` (default the engine's).

        Raises:
            UnknownPageError: a page is in no tier.
            TierFullError: the pages can never be resident at once, or no room came before
                the deadline.
            StoreTimeoutError: pages in flight (a load, a write-back) did not land before it.
        On any error (or cancellation) no pin is left behind.
        """
        todo = list(dict.fromkeys(keys))
        self.ensure_fits(len(todo))
        deadline = self.deadline(timeout)
        table = self.table
        pinned: list[Key] = []
        waited = -1
        try:
            while True:
                ready = [k for k in todo if table.lookup([k], DEVICE)]
                if ready:
                    table.prepare_load(ready, DEVICE)
                    pinned += ready
                    done = set(ready)
                    todo = [k for k in todo if k not in done]
                if waited < 0:
                    waited = len(todo)
                if not todo:
                    return waited
                missing = [k for k in todo if not table.present([k], DEVICE)]
                loadable = [k for k in missing if self._has_lower(k)]
                for k in missing:
                    if k not in loadable and not table.tiers_of(k):
                        raise UnknownPageError(f"page {k.hex()} is in no tier")
                if loadable:
                    got = await self._load(loadable, priority)
                    if got is not None:
                        pinned += got
                        done = set(got)
                        todo = [k for k in todo if k not in done]
                        continue
                    if not self._could_free(len(pinned)):
                        raise self.full_error(len(loadable))
                    if not wait_room and not self._copies_in_flight():
                        raise self.full_error(len(loadable))  # only leases' pins: never wait
                left = list(todo)
                await self.changes.wait(deadline, lambda: self._stuck(left, timeout))  # noqa: B023
        except BaseException:
            if pinned:
                table.complete_load(pinned, DEVICE)
                self.signal_progress()
            raise

    def _stuck(self, todo: list[Key], timeout: float | None) -> TierKVError:
        """The error of a deadline passed: pages still in flight (StoreTimeoutError), or no
        room for the missing ones (TierFullError)."""
        table = self.table
        busy = [k for k in todo if table.tiers_of(k) and not self._has_lower(k)]
        busy += [k for k in todo if table.present([k], DEVICE)]
        waited = self.engine.timeout if timeout is None else timeout
        if busy:
            return StoreTimeoutError(
                f"device tier: {len(busy)} pages in flight did not land in {waited:.3g} s"
            )
        return self.full_error(len(todo), waited)

    def release_device(self, keys: Sequence[Key]) -> None:
        """Unpin pages pinned by :meth:`acquire_device` or :meth:`pin_device` (records their
        use) and wake whoever waits for room."""
        self.table.complete_load(list(dict.fromkeys(keys)), DEVICE)
        self.signal_progress()

    async def _load(self, keys: list[Key], priority: Priority) -> list[Key] | None:
        """Load pages that have a readable lower copy into new device slots and pin them for
        the caller; returns the pages loaded (and pinned), or None when the device has no room
        now. The copies are owned by a task of this class: a cancelled caller never frees a slot
        a copy still writes, and pins that the load took for it are given back."""
        table = self.table
        async with self._device_lock:
            keys = [k for k in keys if not table.present([k], DEVICE) and self._has_lower(k)]
            if not keys:
                return []
            if not await self._make_room(len(keys)):
                return None
            keys = [k for k in keys if not table.present([k], DEVICE) and self._has_lower(k)]
            alloc = table.prepare_store(keys, DEVICE)
            if alloc is None or alloc.evicted:  # room was made under the lock
                if alloc is not None:
                    table.complete_store(alloc.keys, DEVICE, ok=False)
                return None
            self._note_peak()
            new = cast(list[Key], alloc.keys)
            # sources are chosen and pinned now, with no await since the check above
            src: dict[str, tuple[list[Key], list[int]]] = {}
            taken: set[Key] = set()
            for tier in self.lower:
                ks = [k for k in new if k not in taken and table.lookup([k], tier)]
                if ks:
                    src[tier] = (ks, table.prepare_load(ks, tier))
                    taken.update(ks)
        slot_of = dict(zip(new, alloc.slots))
        # submit now, before any await: the copies run while the caller computes
        work: list[tuple[str, int, Awaitable[Any]]] = []
        try:
            for tier, (ks, src_slots) in src.items():
                dst = [slot_of[k] for k in ks]
                if tier == HOST:
                    h = self.engine.submit(
                        self.arenas[HOST], src_slots, self.arenas[DEVICE], dst, priority=priority
                    )
                    work.append((tier, len(ks), h.wait()))
                else:
                    work.append((tier, len(ks), self._decode(src_slots, dst)))
        except BaseException as exc:  # the copies already submitted finish before the rollback
            task = asyncio.ensure_future(self._finish_load(new, src, work, exc))
        else:
            task = asyncio.ensure_future(self._finish_load(new, src, work, None))
        try:
            await asyncio.shield(task)
        except BaseException:
            if task.done():
                if not task.cancelled() and task.exception() is None:
                    self.release_device(new)  # loaded for a caller who is gone
            else:
                task.add_done_callback(lambda t: self._orphan_load(new, t))
            raise
        return new

    def _orphan_load(self, keys: list[Key], task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.release_device(keys)

    async def _finish_load(
        self,
        keys: list[Key],
        src: dict[str, tuple[list[Key], list[int]]],
        work: list[tuple[str, int, Awaitable[Any]]],
        error: BaseException | None,
    ) -> None:
        """Owns a load to its end, even when the task that asked for it is cancelled: commits
        the pages pinned for the caller (or rolls them back) and wakes the waiters."""
        for tier, n, aw in work:
            try:
                res = await aw
            except BaseException as exc:  # roll back: the slots are free again
                error = error or exc
                continue
            if tier == HOST:
                self.stats.copy_s += res.copy_s
                self.timeline.span(
                    "load",
                    "stream host->device",
                    res.started_at,
                    res.finished_at,
                    pages=n,
                    queue_wait_s=res.queue_wait_s,
                )
                self.stats.bytes_h2d += n * self.spec.page_bytes
            self.stats.loads_from[tier] += n
        for tier, (ks, _) in src.items():
            self.table.complete_load(ks, tier)
        self.table.complete_store(keys, DEVICE, ok=error is None)
        if error is None:
            self.table.prepare_load(keys, DEVICE)  # the caller's pins, taken with the commit
        self.signal_progress()
        if error is not None:
            raise error

    def _has_lower(self, key: Key) -> bool:
        return any(self.table.lookup([key], t) for t in self.lower)

    def forget_in(self, tier: str, keys: Sequence[Key]) -> None:
        """Remove readable, unpinned pages from one tier."""
        here = [
            k
            for k in self.table.present(keys, tier)
            if self.table.state(k, tier) == PageState.READABLE and not self.table.pins(k, tier)
        ]
        if here:
            self.table.remove(here, tier)
            if tier == HOST:
                self.host_left(here)

    def host_left(self, keys: Sequence[Hashable]) -> None:
        """Pages left the host tier (evicted, dropped, moved to cold): tell the listeners.
        Call it for every departure outside this class too (a direct ``prepare_store`` on the
        host tier that evicted pages)."""
        if keys and self.host_listeners:
            left = cast(list[Key], list(keys))
            for listener in self.host_listeners:
                listener(left)

    async def offer_remote(self, victims: list[tuple[Key, int]]) -> None:
        """Offer host pages about to leave (pinned or MOVING, so their bytes hold) to the
        remote tier, if any; bounded and best-effort (the remote counts its failures)."""
        if self.remote_offer is not None and victims:
            await self.remote_offer(victims)

    def _note_peak(self) -> None:
        used = self.table.used(DEVICE)
        if used > self.stats.peak_device_pages:
            self.stats.peak_device_pages = used

    def check(self) -> None:
        """Assert the invariants (for tests and debugging). Raises AssertionError.

        The page table's own; every owned page has a copy somewhere; owners' pins are recorded
        exactly on copies that exist; doomed pages are unowned and still somewhere; dirty pages
        are on the device.
        """
        table = self.table
        table.check()
        for k, n in self.owners.items():
            assert n > 0, f"page {k.hex()}: {n} owners"
            assert table.tiers_of(k), f"owned page {k.hex()} is in no tier"
        for k, bits in self.owner_pins.items():
            assert k in self.owners, f"unowned page {k.hex()} holds an owner's pin"
            for t, bit in self._tier_bit.items():
                if bits & bit:
                    assert table.present([k], t), f"owner's pin on a missing {t} copy"
                    assert table.pins(k, t) >= 1, f"owner's pin on {k.hex()} in {t} lost"
        assert self.write_behind_pinned >= 0, "write-behind pins went negative"
        for k in self.doomed:
            assert k not in self.owners, f"doomed page {k.hex()} is owned"
        for k in self.dirty:
            assert table.present([k], DEVICE), f"dirty page {k.hex()} is not on the device"

    def info(self) -> dict[str, Any]:
        """Pages per tier and capacities."""
        return {
            t: {"used": self.table.used(t), "capacity": self.table.capacity(t)}
            for t in self.table.tier_names
        }
