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
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, cast

import torch

from runtime import Arena, Backend, Priority, TransferEngine
from tierkv.codecs import Codec
from tierkv.cold import ColdStorage
from tierkv.errors import TierFullError, UnknownPageError
from tierkv.eviction import DeviceEviction
from tierkv.page_table import PageState, PageTable
from tierkv.spec import KVSpec
from tierkv.tier_stats import COLD, DEVICE, HOST, Key, TierStats
from tierkv.timeline import Timeline


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
        self.loading: dict[Key, asyncio.Future[None]] = {}
        self.stats = TierStats()
        self._device_lock = asyncio.Lock()
        self._busy: set[asyncio.Task[None]] = set()  # write-behind copies holding device pins
        self._progress: asyncio.Future[None] | None = None  # see DeviceEviction.progress
        # pages leaving the host tier: listeners (a page server's announcements) and the
        # remote tier's offer of exact bytes about to be compressed or dropped
        self.host_listeners: list[Callable[[list[Key]], None]] = []
        self.remote_offer: Callable[[list[tuple[Key, int]]], Awaitable[None]] | None = None

    # -- where pages are ---------------------------------------------------------------
    def holds(self, key: Key) -> bool:
        """True when some tier holds ``key`` in a usable state."""
        return (
            any(self.table.lookup([key], t) for t in self.table.tier_names) or key in self.loading
        )

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
        """Remove unowned, unpinned pages from every tier (a released private page)."""
        for t in self.table.tier_names:
            here = [
                k
                for k in self.table.present(keys, t)
                if self.table.state(k, t) == PageState.READABLE and not self.table.pins(k, t)
            ]
            if here:
                self.table.remove(here, t)
                if t == HOST:
                    self.host_left(here)
        for k in keys:
            self.dirty.pop(k, None)

    def rekey(self, old: Sequence[Key], new: Sequence[Key]) -> bool:
        """Rename pages everywhere (private -> content). False (nothing changed) on a clash."""
        if any(self.holds(k) for k in new) or any(k in self.loading for k in old):
            return False
        for t in self.table.tier_names:
            pairs = [(o, n) for o, n in zip(old, new) if self.table.present([o], t)]
            if pairs:
                self.table.rekey([o for o, _ in pairs], [n for _, n in pairs], t)
        for o, n in zip(old, new):
            if o in self.dirty:
                self.dirty[n] = self.dirty.pop(o)
            if o in self.owners:
                self.owners[n] = self.owners.pop(o)
            if o in self.owner_pins:
                self.owner_pins[n] = self.owner_pins.pop(o)
        return True

    # -- device allocation ---------------------------------------------------------------
    async def allocate_device(self, keys: Sequence[Key]) -> list[int]:
        """Reserve device slots for new pages (WRITING) and return them; the caller writes the
        bytes and calls :meth:`commit_device`. Raises TierFullError."""
        async with self._device_lock:
            await self._make_room(len(keys))
            alloc = self.table.prepare_store(keys, DEVICE)
            if alloc is None or alloc.present or alloc.evicted:
                raise TierFullError(f"device tier: no room for {len(keys)} new pages")
            self._note_peak()
            return alloc.slots

    def commit_device(self, keys: Sequence[Key]) -> None:
        """New device pages are written: readable, dirty (no lower copy yet)."""
        self.table.complete_store(keys, DEVICE)
        self.mark_dirty(keys)

    async def acquire_device(self, keys: Sequence[Key], priority: Priority) -> int:
        """Make every page of ``keys`` readable on the device, loading what is not, and pin
        them there (release with :meth:`release_device`). Returns how many pages this call had
        to load or wait for (0 when all were resident: no wait).

        Raises UnknownPageError when a page is in no tier, TierFullError when the device cannot
        make room. On any error (or cancellation) no pin is left behind.
        """
        todo = list(dict.fromkeys(keys))
        pinned: list[Key] = []
        waited = 0
        try:
            for _ in range(16):
                ready = [k for k in todo if self.table.lookup([k], DEVICE)]
                if ready:
                    self.table.prepare_load(ready, DEVICE)
                    pinned += ready
                    done = set(ready)
                    todo = [k for k in todo if k not in done]
                if not todo:
                    break
                waited += len(todo)
                pending: list[Awaitable[None]] = [
                    self.loading[k] for k in todo if k in self.loading
                ]
                pending += [self._moving_done(k) for k in todo if self._moving(k)]
                missing = [k for k in todo if k not in self.loading and not self._moving(k)]
                if pending:
                    await asyncio.gather(*(asyncio.shield(p) for p in pending))
                if missing:
                    await self._load(missing, priority)
            else:
                raise TierFullError(
                    f"device tier thrashing: {len(todo)} pages evicted again before use"
                )
        except BaseException:
            if pinned:
                self.table.complete_load(pinned, DEVICE)
            raise
        return waited

    def release_device(self, keys: Sequence[Key]) -> None:
        """Unpin pages pinned by :meth:`acquire_device` (records their use)."""
        self.table.complete_load(list(dict.fromkeys(keys)), DEVICE)

    def _moving(self, key: Key) -> bool:
        return bool(self.table.present([key], DEVICE)) and (
            self.table.state(key, DEVICE) == PageState.MOVING
        )

    async def _moving_done(self, key: Key) -> None:
        while self._moving(key):  # noqa: ASYNC110 - a write-back ends within the engine timeout
            await asyncio.sleep(0.0005)

    async def _load(self, keys: list[Key], priority: Priority) -> None:
        keys = [k for k in keys if not self.table.present([k], DEVICE)]
        if not keys:
            return
        for k in keys:
            if not self._has_lower(k):
                raise UnknownPageError(f"page {k.hex()} is in no tier")
        async with self._device_lock:
            await self._make_room(len(keys))
            keys = [k for k in keys if not self.table.present([k], DEVICE) and self._has_lower(k)]
            alloc = self.table.prepare_store(keys, DEVICE)
            if alloc is None or alloc.evicted:  # room was made under the lock
                raise TierFullError(f"device tier: no room to load {len(keys)} pages")
            self._note_peak()
            new = cast(list[Key], alloc.keys)
            # sources are chosen and pinned now, with no await since the check above
            src: dict[str, tuple[list[Key], list[int]]] = {}
            taken: set[Key] = set()
            for tier in self.lower:
                ks = [k for k in new if k not in taken and self.table.lookup([k], tier)]
                if ks:
                    src[tier] = (ks, self.table.prepare_load(ks, tier))
                    taken.update(ks)
        loop = asyncio.get_running_loop()
        for k in new:
            self.loading[k] = loop.create_future()
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
        await asyncio.shield(task)

    async def _finish_load(
        self,
        keys: list[Key],
        src: dict[str, tuple[list[Key], list[int]]],
        work: list[tuple[str, int, Awaitable[Any]]],
        error: BaseException | None,
    ) -> None:
        """Owns a load to its end, even when the task that asked for it is cancelled."""
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
        self.signal_progress()
        for k in keys:
            fut = self.loading.pop(k)
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
                fut.exception()  # retrieved: waiters re-raise it; nobody else must log it
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

    def info(self) -> dict[str, Any]:
        """Pages per tier and capacities."""
        return {
            t: {"used": self.table.used(t), "capacity": self.table.capacity(t)}
            for t in self.table.tier_names
        }
