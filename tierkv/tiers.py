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

One owner: :class:`TierSet` is the tier core. It alone holds the page table and the arenas (the
arenas hand their slots over to it, ``Arena.hand_over``: the page table's free lists are the one
record of slots, its page states the one record of what is in flight, its pins the one record of
pins) and it alone changes page state, with two collaborators it builds and hands exactly what
they need: :class:`~tierkv.eviction.DeviceEviction` (room on the device, write-back,
write-behind) and :class:`~tierkv.lower_tiers.ColdStorage` (host room, compression, decoding);
:class:`~tierkv.owners.Owners` keeps the sequences' hold on pages. Everything else (leases,
prefetch, the remote glue, the page server, metrics) uses the public methods below and reads
through :attr:`TierSet.table`, a read-only view. This file stays whole (over 400 lines): it is
that one public surface, and every transition it makes is checked by :meth:`TierSet.check`.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from array import array
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from functools import partial
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from tierkv import page_sums
from tierkv.codecs import Codec
from tierkv.errors import (
    InvalidInputError,
    PageStateError,
    StoreTimeoutError,
    TierFullError,
    TierKVError,
    UnknownPageError,
)
from tierkv.eviction import DeviceEviction
from tierkv.jobs import job_done, when_done, within
from tierkv.keys import PageKey
from tierkv.lower_tiers import ColdStorage, Departures, Offer
from tierkv.owners import Owners
from tierkv.page_sums import NO_SUM, PageCheck, row_sums
from tierkv.page_table import PageState, PageTable, StoreAllocation
from tierkv.runtime import (
    Arena,
    Backend,
    Priority,
    TransferEngine,
    TransferError,
    TransferHandle,
)
from tierkv.spec import KVSpec
from tierkv.stats import TierStats
from tierkv.table_view import TableView
from tierkv.tier_names import COLD, DEVICE, HOST
from tierkv.timeline import Timeline
from tierkv.waits import Changes

__all__ = ["COLD", "DEVICE", "HOST", "HostLoad", "TierSet", "TierStats"]

_NO_INDEX = torch.empty(0, dtype=torch.int64)
_PREFAULT_BYTES = 8 << 20  # device memory committed ahead of use, per prefault

# a remote read into host slots: (keys, the host arena's bytes, slots) -> pages delivered
HostLoad = Callable[[list[PageKey], npt.NDArray[np.uint8], list[int]], Awaitable[int]]
# a lower tier's read into host slots, queued as an engine job: (keys, slots) -> its handle,
# whose result is a hit per key (tierkv.tier: the move registered from that tier to the host)
HostJob = Callable[[list[PageKey], list[int]], TransferHandle]


class Prefaulter:
    """One daemon thread that commits an arena's memory ahead of use (:meth:`Arena.prefault`,
    which releases the GIL), fed by a queue: asking costs the loop a queue put."""

    def __init__(self, arena: Arena) -> None:
        self._arena = arena
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tierkv-prefault", daemon=True)
        self._thread.start()

    def submit(self, first: int, n: int) -> None:
        """Commit slots ``[first, first + n)`` in the background (nothing after close)."""
        if not self._closed:
            self._queue.put((first, n))

    def close(self) -> None:
        """Let the thread end once what was asked is done. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self._arena.prefault(*job)


class TierSet:
    """The tier core of one store: arenas, page table and every move between tiers.

    Used from one event loop. See the module docstring for who may change what.
    """

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
        codec = codec if cold_pages > 0 else None
        arenas: dict[str, Arena] = {
            DEVICE: backend.create_arena(DEVICE, spec.page_bytes, device_pages),
            HOST: backend.create_arena(HOST, spec.page_bytes, host_pages, kind="pinned"),
        }
        tiers = {DEVICE: device_pages, HOST: host_pages}
        if codec is not None:
            arenas[COLD] = backend.create_arena(
                COLD, codec.encoded_bytes(spec), cold_pages, kind="pinned"
            )
            tiers[COLD] = cold_pages
        for arena in arenas.values():  # the page table alone hands out slots
            arena.hand_over()
        self._arenas = arenas
        self._pages = self._page_views(arenas[DEVICE])
        self._by_head = self._pages.permute(1, 2, 0, 3, 4)  # [2, H, slots, T, D]: a view
        # (the store keeps counters; cold copies are encoded: a checksum per cold slot)
        self._table = PageTable(tiers, policy, record_events=False, encoded=self._encoded(tiers))
        self.table = TableView(self._table)
        self.lower = [t for t in (HOST, COLD) if t in tiers]
        self.stats = TierStats()
        self._owners = Owners(self._table, self.lower)
        self._departures = Departures()
        self._cold = ColdStorage(
            spec,
            self._table,
            arenas,
            engine,
            codec,
            self._owners,
            self._departures,
            self.stats,
            self.signal_progress,
        )
        self._evict = DeviceEviction(
            spec,
            self._table,
            arenas,
            engine,
            self.lower,
            self._owners,
            self._cold,
            self._departures,
            self.stats,
            self.timeline,
            self.signal_progress,
        )
        self._device_lock = asyncio.Lock()
        # every change that may free device room or land a page in flight wakes the waiters:
        # in flight is the page state (WRITING / MOVING) alone, pins the page table's alone
        self.changes = Changes()
        self._doomed: set[PageKey] = set()  # released private pages still busy: removed when idle
        # released full blocks still busy (a write-behind copy reads them): renamed to their
        # content keys once idle, so that they are cached, not freed
        self._renames: list[tuple[list[PageKey], list[PageKey]]] = []
        self._reap_due = False  # a reap is scheduled for the next loop turn
        # device slots below this are committed, or being so by a background prefault (the
        # free list hands out the lowest slots first: the arena fills from slot 0 up)
        self._warm = 0
        self._warm_chunk = max(1, _PREFAULT_BYTES // arenas[DEVICE].slot_bytes)
        self._prefaulter = Prefaulter(arenas[DEVICE])
        # the first two chunks now, on this thread, before the first append needs them (a
        # background prefault racing the first appends left them faulting on the loop)
        self._warm = min(arenas[DEVICE].num_slots, 2 * self._warm_chunk)
        arenas[DEVICE].prefault(0, self._warm)

    @staticmethod
    def _encoded(tiers: Mapping[str, int]) -> list[str]:
        return [COLD] if COLD in tiers else []

    def _page_views(self, arena: Arena) -> torch.Tensor:
        # every device slot as a page [2, H, T, D] in the KV dtype, without copies
        spec = self.spec
        raw = arena.tensor[:, : 2 * spec.kv_bytes]
        return raw.view(spec.dtype).view(arena.num_slots, *spec.page_shape)

    # -- read-only state -------------------------------------------------------------------
    @property
    def codec(self) -> Codec | None:
        """The cold tier's codec (None without a cold tier)."""
        return self._cold.codec

    @property
    def owners(self) -> Mapping[PageKey, int]:
        """Live sequences holding each owned page (read-only)."""
        return self._owners.counts

    @property
    def owner_pins(self) -> Mapping[PageKey, int]:
        """Owned pages whose lower copies the owners pin (read-only)."""
        return self._owners.pinned

    @property
    def doomed(self) -> AbstractSet[PageKey]:
        """Released private pages still busy, removed once idle (read-only)."""
        return self._doomed

    @property
    def renames_pending(self) -> int:
        """Released blocks waiting to be idle to be renamed to their content keys."""
        return len(self._renames)

    @property
    def dirty(self) -> Mapping[PageKey, int]:
        """Device pages newer than their lower copies (read-only)."""
        return self._evict.dirty

    @property
    def write_behind_pinned(self) -> int:
        """Device pages pinned by write-behind copies now."""
        return self._evict.write_behind_pinned

    @property
    def device_pages(self) -> torch.Tensor:
        """Every device slot as a page: ``[slots, 2, H, T, D]`` in the KV dtype (a view; the
        step path reads and writes pinned slots through it, :mod:`tierkv.step`)."""
        return self._pages

    @property
    def device(self) -> torch.device:
        """The torch device of the device tier's pages."""
        return self._pages.device

    def slot_bytes(self, tier: str) -> int:
        """Bytes of one slot of ``tier`` (a page, or an encoded page in cold)."""
        return self._arenas[tier].slot_bytes

    def holds(self, key: PageKey) -> bool:
        """True when some tier holds ``key`` (readable, or in flight to readable)."""
        return bool(self._table.tiers_of(key))

    def device_slot(self, key: PageKey) -> int:
        """Device slot of a resident page. Raises UnknownPageError."""
        return self._table.slot(key, DEVICE)

    def page(self, slot: int) -> torch.Tensor:
        """A device slot viewed as a page ``[2, H, T, D]`` (zero-copy)."""
        return self._pages[slot]

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """Device slots gathered into ``[n, 2, H, T, D]`` (one copy)."""
        return self._pages.index_select(0, self._index(slots))

    def gather_tokens(self, slots: Sequence[int]) -> torch.Tensor:
        """Device slots gathered token-major: ``[2, H, n * T, D]`` (K then V; one copy, the
        layout attention reads, with no second copy to reorder it)."""
        n = len(slots)
        _, h, t, d = self.spec.page_shape
        return self._by_head.index_select(2, self._index(slots)).view(2, h, n * t, d)

    def device_slots(self, keys: Sequence[PageKey]) -> list[int]:
        """Device slots of resident pages, in order. Raises UnknownPageError."""
        return self._table.slots(keys, DEVICE)

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        # from a buffer of int64: a third of torch.tensor(list)'s time
        idx = torch.frombuffer(array("q", slots), dtype=torch.int64) if slots else _NO_INDEX
        return idx if self._pages.device.type == "cpu" else idx.to(self._pages.device)

    def pinned_on_device(self, keys: Iterable[PageKey]) -> bool:
        """Whether some of ``keys`` is pinned on the device (by a lease or a copy)."""
        table = self._table
        return any(table.pins(k, DEVICE) for k in table.present(keys, DEVICE))

    def device_room(self, keys: Sequence[PageKey], protect: AbstractSet[PageKey]) -> list[PageKey]:
        """The pages of ``keys`` not readable on the device (in order) that fit there now
        without evicting a page of ``protect`` or a pinned or in-flight one."""
        table = self._table
        ready = set(table.readable(keys, DEVICE))
        absent = [k for k in keys if k not in ready]
        if not absent:
            return []
        free = table.capacity(DEVICE) - table.used(DEVICE)
        junk = sum(
            1
            for k in table.keys(DEVICE)
            if k not in protect
            and table.state(k, DEVICE) == PageState.READABLE
            and not table.pins(k, DEVICE)
        )
        return absent[: max(0, free + junk)]

    # -- announcements -----------------------------------------------------------------
    def announce(self, keys: Iterable[PageKey]) -> None:
        """Pages the coming steps read, soonest needed first (the server's schedule): device
        evictions take them only when no other page can go, the last needed first, whatever
        the policy ranks (the schedule outranks it)."""
        order = tuple(keys)
        self._evict.soon_order = order
        self._evict.soon = frozenset(order)

    def touch_device(self, keys: Iterable[PageKey]) -> None:
        """Mark readable device pages as just used (the policy's recency)."""
        here = self._table.readable(keys, DEVICE)
        if here:
            self._table.touch(here, DEVICE)

    # -- ownership ---------------------------------------------------------------------
    def own(self, keys: Sequence[PageKey]) -> None:
        """A live sequence holds ``keys``: pin their lower copies so none is dropped."""
        owners, doomed = self._owners, self._doomed
        for k in keys:
            if owners.add(k):
                owners.pin_lower(k)
            if doomed:
                doomed.discard(k)

    async def own_async(self, keys: Sequence[PageKey], batch: int = 4096) -> None:
        """:meth:`own` in slices with a loop turn between them (a million-token prompt owns
        125,000 pages: one pass blocked the loop ~0.2 s). Cancelled midway, it undoes what it
        did (nothing stays owned)."""
        done = 0
        try:
            while done < len(keys):
                part = keys[done : done + batch]
                self.own(part)
                done += len(part)
                if done < len(keys):
                    await asyncio.sleep(0)
        except BaseException:
            self.disown(keys[:done])
            raise

    def disown(self, keys: Sequence[PageKey]) -> None:
        """Drop one owner of each key; unowned pages become evictable cache."""
        drop = self._owners.drop
        for k in keys:
            drop(k)

    def forget(self, keys: Sequence[PageKey]) -> None:
        """Remove released private pages from every tier. Copies busy now (pinned by a copy or a
        lease, or in flight) are *doomed*: removed as soon as they are idle (see :meth:`reap`),
        so a release during a write-behind copy or inside a lease leaks nothing."""
        dirty = self._evict.dirty
        for k in keys:
            dirty.pop(k, None)
        self._doomed.update(k for k in keys if k not in self._owners)
        self.reap()

    def rename_when_idle(self, old: Sequence[PageKey], new: Sequence[PageKey]) -> None:
        """Rename released, unowned pages (a full block's private keys -> its content keys)
        now, or as soon as they are idle (see :meth:`rekey`): a block busy at release is cached,
        not freed. When ``new`` is held by then (another sequence published the same block),
        the ``old`` pages go as released private pages do."""
        if not self.rekey(old, new):
            self._renames.append((list(old), list(new)))

    def _retry_renames(self) -> None:
        table, left = self._table, []
        for old, new in self._renames:
            if not any(table.tiers_of(k) for k in old):
                continue  # evicted meanwhile: nothing to rename
            if any(table.tiers_of(k) for k in new):
                for k in old:  # the block is cached under its content key already: old goes
                    self._evict.dirty.pop(k, None)
                self._doomed.update(old)
                continue
            if not self.rekey(old, new):
                left.append((old, new))
        self._renames = left

    def reap(self) -> None:
        """Remove the doomed pages that are idle now (readable, unpinned) from every tier, and
        give released busy blocks their content keys once they are idle."""
        if self._renames:
            self._retry_renames()
        if self._cold.bad:
            self._cold.drop_bad()
        if not self._doomed:
            return
        table, doomed = self._table, list(self._doomed)
        for t in table.tier_names:
            self._cold.forget_in(t, doomed)  # (only the idle ones go)
        dirty = self._evict.dirty
        for k in doomed:  # a doomed page's device copy is never written back
            dirty.pop(k, None)
        self._doomed = set(cast(list[PageKey], table.held(doomed)))

    def idle(self, key: PageKey) -> bool:
        """True when no copy of ``key`` is in flight or pinned by anything but its owners."""
        table = self._table
        for t in table.tiers_of(key):
            if table.state(key, t) != PageState.READABLE:
                return False
            if table.pins(key, t) != (1 if self._owners.holds_pin(key, t) else 0):
                return False
        return True

    def rekey(self, old: Sequence[PageKey], new: Sequence[PageKey]) -> bool:
        """Rename pages everywhere (private -> content). False (nothing changed) when a new key
        is in some tier (in any state) or an old page is busy: in flight (a load, a write-back,
        a compression) or pinned by a copy or a lease. So a rename never races an eviction:
        the copy that moves a page completes under the name it started with."""
        table = self._table
        if any(table.tiers_of(k) for k in new) or not all(self.idle(k) for k in old):
            return False
        if any(k in self._doomed for k in old):
            return False
        for t in table.tier_names:
            pairs = [(o, n) for o, n in zip(old, new) if table.present([o], t)]
            if pairs:
                table.rekey([o for o, _ in pairs], [n for _, n in pairs], t)
        dirty = self._evict.dirty
        for o, n in zip(old, new):
            if o in dirty:
                dirty[n] = dirty.pop(o)
            self._owners.rename(o, n)
        return True

    # -- waiting ---------------------------------------------------------------------------
    def signal_progress(self) -> None:
        """Device state changed (a copy ended, a pin went, a page left): wake whoever waits for
        room or for a page in flight, and reap the doomed pages that became idle.

        Reaping walks every doomed page, and a busy loop signals progress thousands of times a
        second while a hundred pages stay doomed (pinned by write-behind copies): so the reap
        runs once per loop turn, from a callback of its own, and wakes the waiters again if it
        freed something."""
        if (self._doomed or self._renames or self._cold.bad) and not self._reap_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): reap now
                self.reap()
            else:
                self._reap_due = True
                loop.call_soon(self._reap_turn)
        self.changes.notify()

    def _reap_turn(self) -> None:
        self._reap_due = False
        before = len(self._doomed) + len(self._renames)
        self.reap()
        if len(self._doomed) + len(self._renames) < before:
            self.changes.notify()

    def deadline(self, timeout: float | None = None) -> float:
        """Loop time ``timeout`` seconds from now (default: the engine's timeout)."""
        return self.changes.deadline(self.engine.timeout if timeout is None else timeout)

    def _could_free(self, mine: int) -> bool:
        """Whether device pages pinned or in flight for others than the caller (who holds
        ``mine`` of them pinned) may go, or victims were put back for host copies busy with
        copies of their own, so that waiting for room can succeed."""
        t = self._table
        return t.used(DEVICE) - t.evictable(DEVICE) > mine or self._evict.lower_busy

    def _copies_in_flight(self) -> bool:
        """Whether device pages are held by copies that end on their own: write-behind
        reads, loads (WRITING) or write-backs (MOVING), as opposed to leases' pins."""
        if self._evict.write_behind_pinned or self._evict.lower_busy:
            return True
        t = self._table
        return any(t.state(k, DEVICE) != PageState.READABLE for k in t.keys(DEVICE))

    def full_error(self, n: int, waited: float | None = None) -> TierFullError:
        """The error of a device with no room for ``n`` pages (after ``waited`` seconds)."""
        t = self._table
        free = t.capacity(DEVICE) - t.used(DEVICE)
        pinned = t.used(DEVICE) - t.evictable(DEVICE)
        after = f" after waiting {waited:.3g} s" if waited is not None else ""
        return TierFullError(
            f"device tier full{after}: {n} pages needed, {free} free, {pinned} pinned or in "
            f"flight (capacity {t.capacity(DEVICE)} pages of {self.spec.page_bytes} B)"
        )

    def ensure_fits(self, n: int) -> None:
        """Raise TierFullError at once when ``n`` pages can never be resident together."""
        cap = self._table.capacity(DEVICE)
        if n > cap:
            raise TierFullError(
                f"device tier: {n} pages can never be resident at once (capacity {cap} pages "
                f"of {self.spec.page_bytes} B)"
            )

    # -- writes that leases and background work ask for ------------------------------------
    def zero_device(self, slots: Sequence[int]) -> None:
        """Zero device slots (new pages start clean, whatever the slot held before)."""
        arena = self._arenas[DEVICE]
        for s in slots:  # a handful of pages: a memset each (index_fill_ scans the whole arena)
            arena.slot_view(s).zero_()

    def mark_dirty(self, keys: Sequence[PageKey]) -> None:
        """Device copies of ``keys`` were written: newer than any lower copy."""
        self._evict.mark_dirty(keys)

    async def write_behind(self, keys: Sequence[PageKey]) -> int:
        """Copy dirty device pages of ``keys`` down to the host now; returns pages written
        (see :meth:`tierkv.eviction.DeviceEviction.write_behind`)."""
        return await self._evict.write_behind(keys)

    async def compress_idle(self, keys: Sequence[PageKey]) -> int:
        """Compress idle host pages into cold; returns how many (see
        :meth:`tierkv.lower_tiers.ColdStorage.compress_idle`)."""
        return await self._cold.compress_idle(keys)

    def forget_in(self, tier: str, keys: Sequence[PageKey]) -> None:
        """Remove the readable, unpinned pages of ``keys`` from one tier."""
        self._cold.forget_in(tier, keys)

    # -- page checksums (tierkv.page_sums) ----------------------------------------------------
    def seal(self, keys: Sequence[PageKey]) -> None:
        """Device pages whose content is final (an append filled them): record the CRC-32C of
        their bytes, in one native call. Where the device is not host memory (CUDA) the bytes
        are not read back: those pages get theirs when first published (:meth:`host_sums`)."""
        if keys and self._pages.device.type == "cpu" and page_sums.enabled():
            slots = self._table.slots(keys, DEVICE)
            self._table.sums.set(keys, row_sums(self._arenas[DEVICE].array, slots))

    def set_sums(self, keys: Sequence[PageKey], sums: Sequence[int]) -> None:
        """Record the checksums of pages whose bytes were verified on arrival (a peer's)."""
        self._table.sums.set(keys, sums)

    def host_sums(self, keys: Sequence[PageKey], slots: Sequence[int]) -> list[int]:
        """The checksums of host pages ``keys`` (at ``slots``, pinned by the caller) about to
        leave this process: the recorded ones, and for pages without one (sealed on a CUDA
        device, or imported before checksums) the CRC-32C of the host row, recorded now. Empty
        when checksums are off."""
        if not page_sums.enabled():
            return []
        sums = self._table.sums.get(keys)
        missing = [i for i, c in enumerate(sums) if c == NO_SUM]
        if missing:
            got = row_sums(self._arenas[HOST].array, [slots[i] for i in missing])
            for i, c in zip(missing, got):
                sums[i] = c
            self._table.sums.set([keys[i] for i in missing], got)
        return sums

    def count_corrupt(self, tier: str, n: int) -> None:
        """``n`` pages read from ``tier`` failed their checksum (dropped, never served)."""
        if n > 0:
            self.stats.corrupt[tier] = self.stats.corrupt.get(tier, 0) + n

    def _imported(
        self, keys: Sequence[PageKey], slots: Sequence[int], check: PageCheck | None, tier: str
    ) -> None:
        """Record the checksums of pages imported into host ``slots``: the ones the source
        verified, else (a source that does not check) computed from the bytes as they landed."""
        if check is not None:
            self.count_corrupt(tier, check.corrupt)
        if not keys or not page_sums.enabled():
            return
        sums = check.sums[: len(keys)] if check is not None else []
        if len(sums) < len(keys):
            sums = row_sums(self._arenas[HOST].array, slots)
        self._table.sums.set(keys, sums)

    # -- the host tier, for the remote glue and the page server --------------------------------
    @property
    def host_array(self) -> npt.NDArray[np.uint8]:
        """The host arena's bytes, ``[slots, page_bytes]`` (what transports register)."""
        return self._arenas[HOST].array

    @property
    def host_arena(self) -> Arena:
        """The host tier's arena (its size and backend; its slots belong to this core)."""
        return self._arenas[HOST]

    def replace_host_arena(self, arena: Arena) -> None:
        """Put the host tier on other memory of the same shape (shared with peers). Raises
        PageStateError when the host tier holds pages, or the shape differs."""
        old = self._arenas[HOST]
        if self._table.used(HOST):
            raise PageStateError("the host arena can only be replaced while it holds no page")
        if (arena.slot_bytes, arena.num_slots) != (old.slot_bytes, old.num_slots):
            raise PageStateError(
                f"host arena of {arena.num_slots} x {arena.slot_bytes} B cannot replace "
                f"{old.num_slots} x {old.slot_bytes} B"
            )
        arena.hand_over()
        self._arenas[HOST] = arena

    def add_host_listener(self, listener: Callable[[list[PageKey]], None]) -> None:
        """Call ``listener(keys)`` whenever pages leave the host tier."""
        self._departures.listeners.append(listener)

    def remove_host_listener(self, listener: Callable[[list[PageKey]], None]) -> None:
        """Stop calling ``listener`` (no error when it is not registered)."""
        if listener in self._departures.listeners:
            self._departures.listeners.remove(listener)

    def set_spill(self, spill: Offer | None) -> None:
        """Give the pages leaving the host tier (exact bytes, pinned while awaited) to the
        tiers below it (`tierkv.chain.LowerChain.spill`), or stop (None)."""
        self._departures.spill = spill

    def set_remote_offer(self, offer: Offer | None) -> None:
        """The remote tier's offer of host pages about to leave (None: no remote tier)."""
        self._departures.offer = offer

    @property
    def remote_offer(self) -> Offer | None:
        """The remote tier's offer, if one is set."""
        return self._departures.offer

    async def make_host_room(self, n: int) -> None:
        """Free ``n`` host slots if it can: victims offered to the remote tier, compressed or
        dropped (never owned pages)."""
        await self._cold.make_room(n)

    def reserve_host(self, keys: Sequence[PageKey]) -> StoreAllocation | None:
        """Reserve host slots for new pages (WRITING) that a peer or a test writes; returns
        the allocation (``keys`` reserved, ``slots``, ``present``: already held), or None when
        the host is full of pinned pages. Pages evicted for room are announced. Commit with
        :meth:`commit_host`."""
        alloc = self._table.prepare_store(keys, HOST)
        if alloc is not None:
            self._departures.left(alloc.evicted)
        return alloc

    def commit_host(self, keys: Sequence[PageKey], ok: bool = True) -> None:
        """End a :meth:`reserve_host`: the pages are readable (``ok``) or rolled back."""
        if keys:
            self._table.complete_store(keys, HOST, ok=ok)
            self.signal_progress()

    def rename_reserved_host(self, keys: Sequence[PageKey], new: Sequence[PageKey]) -> None:
        """Rename pages of a :meth:`reserve_host` that are still WRITING (same slots, still
        unreadable): the page server fences an expired reservation's slots this way. Raises
        UnknownPageError / PageStateError as ``PageTable.rekey``."""
        if keys:
            self._table.rekey(keys, new, HOST)

    def pin_host(self, keys: Sequence[PageKey]) -> list[int]:
        """Pin readable host pages (none can be evicted) and return their slots. Raises
        PageStateError / UnknownPageError (nothing pinned) when one is not readable."""
        return self._table.prepare_load(keys, HOST) if keys else []

    def unpin_host(self, keys: Sequence[PageKey]) -> None:
        """Drop pins taken by :meth:`pin_host`."""
        if keys:
            self._table.complete_load(keys, HOST)
            self.signal_progress()

    async def import_host(
        self,
        keys: Sequence[PageKey],
        load: HostLoad | None = None,
        *,
        job: HostJob | None = None,
        timeout: float | None = None,
        make_room: bool = True,
        check: PageCheck | None = None,
        tier: str = "peer",
    ) -> int:
        """Bring pages no tier holds into the host tier from a remote peer: room is made (the
        victims offered, compressed or dropped; with ``make_room=False`` only what the policy
        drops by itself), slots reserved, ``load(keys, host bytes, slots)`` run as an async
        job of the transfer engine, and the first pages it delivered committed, the rest
        rolled back (also on error or cancellation). Returns the pages imported (0 when there
        is no room and ``make_room``). Raises TierFullError (``make_room=False`` and the host
        is full of pinned pages), what ``load`` raised (TransferError wraps it) or
        WaitTimeoutError after ``timeout`` (the engine's by default). ``check``: what ``load``
        reports of the pages' checksums (verified ones are recorded; the corrupt ones counted
        under ``tier``); without it the checksums are computed from the bytes that landed.
        ``job`` instead of ``load``: a lower tier's move, which queues its own engine job and
        reports a hit per key (each hit committed, each miss rolled back)."""
        if (load is None) == (job is None):
            raise InvalidInputError("import_host takes a load or a job, not both or neither")
        want = self._nowhere(list(dict.fromkeys(keys)))
        if not want:
            return 0
        if make_room:
            await self._cold.make_room(len(want))
            want = self._nowhere(want)
        alloc = self.reserve_host(want) if want else None
        if alloc is None and not make_room:
            raise TierFullError(f"host tier: no room to import {len(want)} pages")
        if alloc is None or not alloc.keys:
            return 0
        new, slots = cast(list[PageKey], list(alloc.keys)), list(alloc.slots)
        host = self._arenas[HOST]
        try:
            if job is not None:
                handle = job(new, slots)
            else:
                assert load is not None
                handle = self.engine.submit_async(
                    host,
                    [],
                    host,
                    slots,
                    lambda: load(new, host.array, slots),
                    priority=Priority.PREFETCH,
                )
        except BaseException:  # nothing queued (the engine closed, a bad size): roll back
            self.commit_host(new, ok=False)
            raise

        def settle() -> None:
            hits = _hits(handle.result() if handle.exception() is None else 0, len(new))
            got = [i for i, h in enumerate(hits) if h]
            keep = [new[i] for i in got]
            self._imported(keep, [slots[i] for i in got], check, tier)
            self.commit_host(keep)
            self.commit_host([k for k, h in zip(new, hits, strict=True) if not h], ok=False)

        try:
            await within(self.deadline(timeout), job_done(handle), lambda: _late(len(new)))
        except BaseException:
            handle.cancel()
            when_done(handle, settle)
            raise
        settle()
        return sum(_hits(handle.result(), len(new)))

    async def copy_host_out(self, slots: Sequence[int], copy: Callable[[], None]) -> None:
        """Run ``copy``, which reads host ``slots`` into a buffer of the caller's (the remote
        push's staging), as a host-function job of the transfer engine, and wait until it has
        run: also when the caller is cancelled, so that the caller's buffer rows and the host
        slots are never reused while it reads or writes them. Raises what ``copy`` raised."""
        host = self._arenas[HOST]
        handle = self.engine.submit_call(host, slots, host, [], copy, priority=Priority.WRITEBACK)
        waiter = asyncio.ensure_future(job_done(handle))
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if not handle.cancel():  # running: a gather of a few pages, let it end first
                with contextlib.suppress(BaseException):
                    await waiter
            raise
        except TransferError as exc:
            raise (exc.__cause__ or exc) from None

    async def run_remote(self, call: Callable[[], Awaitable[int]]) -> int:
        """Run a remote call that touches no host slot (it reads a buffer of the caller's: the
        push staging) as an async job of the transfer engine, to its end (``call`` bounds
        itself). Returns what it returned; raises what it raised (unwrapped)."""
        host = self._arenas[HOST]
        handle = self.engine.submit_async(host, [], host, [], call, priority=Priority.WRITEBACK)
        try:
            await job_done(handle)
        except TransferError as exc:
            raise (exc.__cause__ or exc) from None
        return cast(int, handle.result())

    async def export_host(
        self,
        keys: Sequence[PageKey],
        send: HostLoad,
        *,
        timeout: float | None = None,
    ) -> int:
        """Send readable host pages to a remote peer: pinned (never evicted or reused) while
        ``send(keys, host bytes, slots)`` runs as an async job of the transfer engine, then
        unpinned. Returns what ``send`` returned (the pages the peer stored). Raises what it
        raised (TransferError wraps it), WaitTimeoutError after ``timeout``."""
        keys = list(keys)
        if not keys:
            return 0
        slots = self.pin_host(keys)
        host = self._arenas[HOST]
        try:
            handle = self.engine.submit_async(
                host,
                slots,
                host,
                [],
                lambda: send(keys, host.array, slots),
                priority=Priority.WRITEBACK,
            )
        except BaseException:  # nothing queued (the engine closed): the pins go
            self.unpin_host(keys)
            raise
        try:
            await within(self.deadline(timeout), job_done(handle), lambda: _late(len(keys)))
        except BaseException:
            handle.cancel()
            when_done(handle, lambda: self.unpin_host(keys))
            raise
        self.unpin_host(keys)
        return cast(int, handle.result())

    # -- device allocation ---------------------------------------------------------------
    async def reserve_device(
        self, keys: Sequence[PageKey], *, mine: int = 0, timeout: float | None = None
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
                if self._table.present(keys, DEVICE):
                    raise PageStateError(f"{len(keys)} new pages: some are already on the device")
                if await self._evict.make_room(len(keys), deadline):
                    alloc = self._table.prepare_store(keys, DEVICE)
                    if alloc is not None and not alloc.evicted:
                        self._note_peak()
                        self._warm_ahead(alloc.slots)
                        return alloc.slots
                    if alloc is not None:  # the policy made room by itself: undo, use ours
                        self._table.complete_store(alloc.keys, DEVICE, ok=False)
            if not self._could_free(mine):
                raise self.full_error(len(keys))
            waited = self.engine.timeout if timeout is None else timeout
            await self.changes.wait(deadline, partial(self.full_error, len(keys), waited))

    def commit_device(self, keys: Sequence[PageKey]) -> None:
        """New device pages are written: readable, dirty (no lower copy yet)."""
        self._table.complete_store(keys, DEVICE)
        self.mark_dirty(keys)

    def abort_device(self, keys: Sequence[PageKey], *, pinned: bool, owned: bool) -> None:
        """Undo new pages reserved by :meth:`reserve_device` (WRITING), or committed and then
        ``pinned`` (:meth:`pin_device`) and ``owned`` (:meth:`own`): a failed append leaves no
        page, pin or owner behind."""
        if not keys:
            return
        table = self._table
        if owned:
            self.disown(keys)
        if pinned:
            table.complete_load(keys, DEVICE)
        writing = [k for k in keys if table.state(k, DEVICE) == PageState.WRITING]
        if writing:
            table.complete_store(writing, DEVICE, ok=False)
        rest = [k for k in keys if k not in set(writing)]
        self._evict.clean(keys)
        if rest:
            table.remove(rest, DEVICE)
        self.signal_progress()

    def pin_device(self, keys: Sequence[PageKey]) -> None:
        """Pin readable device pages (unpin with :meth:`unpin_device`)."""
        self._table.prepare_load(keys, DEVICE)

    async def acquire_device(
        self,
        keys: Sequence[PageKey],
        priority: Priority,
        *,
        wait_room: bool = True,
        timeout: float | None = None,
    ) -> int:
        """Make every page of ``keys`` readable on the device, loading what is not, and pin
        them there (release with :meth:`unpin_device`). Returns how many pages this call had
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
        table = self._table
        pinned: list[PageKey] = []
        waited = -1
        try:
            while True:
                ready = cast(list[PageKey], table.readable(todo, DEVICE))
                if ready:
                    table.prepare_load(ready, DEVICE)
                    pinned += ready
                    done = set(ready)
                    todo = [k for k in todo if k not in done]
                if waited < 0:
                    waited = len(todo)
                if not todo:
                    return waited
                missing = cast(list[PageKey], table.absent(todo, DEVICE))
                loadable = self._evict.with_lower(missing)
                if len(loadable) < len(missing):
                    held = set(table.held(missing))
                    for k in missing:
                        if k not in held:
                            raise UnknownPageError(f"page {k.hex()} is in no tier")
                if loadable:
                    got = await self._load(loadable, priority, deadline)
                    if got is not None:
                        pinned += got
                        done = set(got)
                        todo = [k for k in todo if k not in done]
                        continue
                    if not self._could_free(len(pinned)):
                        raise self.full_error(len(loadable))
                    if not wait_room and not self._copies_in_flight():
                        raise self.full_error(len(loadable))  # only leases' pins: never wait
                # (partials, not closures: cells would be tracked objects for the whole wait)
                await self.changes.wait(deadline, partial(self._stuck, list(todo), timeout))
        except BaseException:
            if pinned:
                table.complete_load(pinned, DEVICE)
                self.signal_progress()
            raise

    def _stuck(self, todo: list[PageKey], timeout: float | None) -> TierKVError:
        """The error of a deadline passed: pages still in flight (StoreTimeoutError), or no
        room for the missing ones (TierFullError)."""
        table = self._table
        safe = set(self._evict.with_lower(todo))
        busy = [k for k in table.held(todo) if k not in safe]
        busy += table.present(todo, DEVICE)
        waited = self.engine.timeout if timeout is None else timeout
        if busy:
            return StoreTimeoutError(
                f"device tier: {len(busy)} pages in flight did not land in {waited:.3g} s"
            )
        return self.full_error(len(todo), waited)

    def unpin_device(self, keys: Sequence[PageKey]) -> None:
        """Unpin pages pinned by :meth:`acquire_device` or :meth:`pin_device` (records their
        use) and wake whoever waits for room."""
        self._table.complete_load(list(dict.fromkeys(keys)), DEVICE)
        self.signal_progress()

    async def _load(
        self, keys: list[PageKey], priority: Priority, deadline: float
    ) -> list[PageKey] | None:
        """Load pages that have a readable lower copy into new device slots and pin them for
        the caller; returns the pages loaded (and pinned), or None when the device has no room
        now. The copies are owned by a task of this class: a cancelled caller never frees a slot
        a copy still writes, and pins that the load took for it are given back."""
        table = self._table
        async with self._device_lock:
            keys = self._evict.with_lower(cast(list[PageKey], table.absent(keys, DEVICE)))
            if not keys:
                return []
            if not await self._evict.make_room(len(keys), deadline):
                return None
            keys = self._evict.with_lower(cast(list[PageKey], table.absent(keys, DEVICE)))
            alloc = table.prepare_store(keys, DEVICE)
            if alloc is None or alloc.evicted:  # room was made under the lock
                if alloc is not None:
                    table.complete_store(alloc.keys, DEVICE, ok=False)
                return None
            self._note_peak()
            self._warm_ahead(alloc.slots)
            new = cast(list[PageKey], alloc.keys)
            # sources are chosen and pinned now, with no await since the check above
            src: dict[str, tuple[list[PageKey], list[int]]] = {}
            taken: set[PageKey] = set()
            for tier in self.lower:
                ks = cast(list[PageKey], table.readable([k for k in new if k not in taken], tier))
                if ks:
                    src[tier] = (ks, table.prepare_load(ks, tier))
                    taken.update(ks)
        slot_of = dict(zip(new, alloc.slots))
        # submit now, before any await: the copies run while the caller computes
        work: list[tuple[str, int, TransferHandle]] = []
        try:
            for tier, (ks, src_slots) in src.items():
                dst = [slot_of[k] for k in ks]
                if tier == HOST:
                    h = self.engine.submit(
                        self._arenas[HOST], src_slots, self._arenas[DEVICE], dst, priority=priority
                    )
                else:
                    h = self._cold.decode(src_slots, dst, priority, ks)
                work.append((tier, len(ks), h))
        except BaseException as exc:  # the copies already submitted finish before the rollback
            task = asyncio.ensure_future(self._finish_load(new, src, work, exc))
        else:
            task = asyncio.ensure_future(self._finish_load(new, src, work, None))
        try:
            await within(deadline, asyncio.shield(task), partial(_in_flight, len(new)))
        except BaseException:
            if task.done():
                if not task.cancelled() and task.exception() is None:
                    self.unpin_device(new)  # loaded for a caller who is gone
            else:
                task.add_done_callback(partial(self._orphan_load, new))
            raise
        return new

    def _orphan_load(self, keys: list[PageKey], task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.unpin_device(keys)

    async def _finish_load(
        self,
        keys: list[PageKey],
        src: dict[str, tuple[list[PageKey], list[int]]],
        work: list[tuple[str, int, TransferHandle]],
        error: BaseException | None,
    ) -> None:
        """Owns a load to its end, even when the task that asked for it is cancelled: commits
        the pages pinned for the caller (or rolls them back) and wakes the waiters."""
        for tier, n, handle in work:
            try:
                res = await job_done(handle)  # the slots are the copy's until it has ended
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
            self._table.complete_load(ks, tier)
        error = self._cold.corrupt(error)  # a cold copy failed its checksum: dropped, typed
        self._table.complete_store(keys, DEVICE, ok=error is None)
        if error is None:
            self._table.prepare_load(keys, DEVICE)  # the caller's pins, taken with the commit
        self.signal_progress()
        if error is not None:
            raise error

    def _warm_ahead(self, slots: Sequence[int]) -> None:
        """Keep the device arena's memory committed a chunk ahead of the highest slot in use,
        from a thread of its own (started with the tier core: starting one on the loop's thread
        while it runs cost tens of ms): new pages are written on the loop's thread (appends),
        and a first write to an uncommitted huge page stalls it ~1-5 ms (see
        :meth:`Arena.prefault`)."""
        arena = self._arenas[DEVICE]
        top = max(slots, default=-1) + 1
        if top + self._warm_chunk <= self._warm or self._warm >= arena.num_slots:
            return
        first = self._warm
        # two chunks ahead: the thread has a chunk's worth of appends to commit the next one
        self._warm = min(arena.num_slots, max(first, top) + 2 * self._warm_chunk)
        self._prefaulter.submit(first, self._warm - first)

    def close(self) -> None:
        """Stop the background thread (the prefault of the device arena). Idempotent."""
        self._prefaulter.close()

    def _nowhere(self, keys: list[PageKey]) -> list[PageKey]:
        """The keys no tier holds, in order."""
        held = set(self._table.held(keys))
        return [k for k in keys if k not in held]

    def _note_peak(self) -> None:
        used = self._table.used(DEVICE)
        if used > self.stats.peak_device_pages:
            self.stats.peak_device_pages = used

    def check(self) -> None:
        """Assert the invariants (for tests and debugging). Raises AssertionError.

        The page table's own; every owned page has a copy somewhere; owners' pins are recorded
        exactly on copies that exist; doomed pages are unowned and still somewhere; dirty pages
        are on the device.
        """
        table = self._table
        table.check()
        self._owners.check()
        assert self._evict.write_behind_pinned >= 0, "write-behind pins went negative"
        for k in self._doomed:
            assert k not in self._owners, f"doomed page {k.hex()} is owned"
        for old, _ in self._renames:
            for k in old:
                assert k not in self._owners, f"page {k.hex()} to be renamed is owned"
        for k in self._evict.dirty:
            assert table.present([k], DEVICE), f"dirty page {k.hex()} is not on the device"

    def info(self) -> dict[str, Any]:
        """Pages per tier and capacities."""
        return {
            t: {"used": self._table.used(t), "capacity": self._table.capacity(t)}
            for t in self._table.tier_names
        }


def _late(n: int) -> StoreTimeoutError:
    return StoreTimeoutError(f"a remote transfer of {n} pages did not end in time")


def _in_flight(n: int) -> StoreTimeoutError:
    return StoreTimeoutError(f"device tier: {n} pages being loaded did not land in time")


def _hits(got: object, n: int) -> list[bool]:
    """A load's answer as a hit per key: a count (the first ``got`` pages delivered) or a list
    of hits (a lower tier's move); anything else is no hit."""
    if type(got) is int:
        ok = max(0, min(got, n))
        return [True] * ok + [False] * (n - ok)
    if isinstance(got, list) and len(got) == n:
        return [h is True for h in got]
    return [False] * n
