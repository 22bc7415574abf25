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
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from runtime import Arena, Backend, Priority, TransferEngine
from tierkv.codecs import Codec
from tierkv.errors import TierFullError, UnknownPageError
from tierkv.page_table import PageState, PageTable
from tierkv.spec import KVSpec
from tierkv.timeline import Timeline

DEVICE, HOST, COLD = "device", "host", "cold"
Key = bytes


@dataclass(slots=True)
class TierStats:
    """Counters of a :class:`TierSet` (all monotonic except ``peak_device_pages``)."""

    loads_from: dict[str, int] = field(default_factory=lambda: {HOST: 0, COLD: 0})
    pages_written_back: int = 0
    pages_compressed: int = 0
    pages_dropped: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    copy_s: float = 0.0
    decode_s: float = 0.0
    encode_s: float = 0.0
    peak_device_pages: int = 0


class TierSet:
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
        self.owners: dict[Key, int] = {}
        self.loading: dict[Key, asyncio.Future[None]] = {}
        self.stats = TierStats()
        self._device_lock = asyncio.Lock()
        self._busy: set[asyncio.Task[None]] = set()  # write-behind copies holding device pins

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
                for t in self.lower:
                    if self.table.lookup([k], t):
                        self.table.prepare_load([k], t)

    def disown(self, keys: Sequence[Key]) -> None:
        """Drop one owner of each key; unowned pages become evictable cache."""
        for k in keys:
            n = self.owners.get(k, 0)
            if n <= 1:
                self.owners.pop(k, None)
                for t in self.lower:
                    if self.table.present([k], t) and self.table.pins(k, t):
                        self.table.complete_load([k], t)
            else:
                self.owners[k] = n - 1

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
        for k in keys:
            fut = self.loading.pop(k)
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
                fut.exception()  # retrieved: waiters re-raise it; nobody else must log it
        if error is not None:
            raise error

    def _decode(self, cold_slots: list[int], dev_slots: list[int]) -> asyncio.Future[None]:
        """Decode cold pages into device slots on a worker thread (started now)."""
        codec, spec, stats = self.codec, self.spec, self.stats
        assert codec is not None
        cold, dev = self.arenas[COLD], self.arenas[DEVICE]

        def work() -> None:
            t0 = time.perf_counter()
            data = cold.tensor.index_select(0, torch.tensor(cold_slots))
            out = torch.empty((len(cold_slots), spec.page_bytes), dtype=torch.uint8)
            codec.decode(data, spec, out=out)
            target = dev.tensor
            idx = torch.tensor(dev_slots, device=target.device)
            target.index_copy_(0, idx, out.to(target.device))
            stats.decode_s += time.perf_counter() - t0

        return asyncio.get_running_loop().run_in_executor(None, work)

    async def _make_room(self, n: int) -> None:
        """Free ``n`` device slots: victims by policy, written back when needed, then dropped."""
        table = self.table
        free = table.capacity(DEVICE) - table.used(DEVICE)
        if free >= n:
            return
        deadline = time.monotonic() + self.engine.timeout
        while True:
            victims = cast(list[tuple[Key, int]], table.prepare_evict(DEVICE, n - free))
            if len(victims) >= n - free:
                break
            table.complete_evict([k for k, _ in victims], DEVICE, ok=False)
            inflight: list[Any] = [*self._busy, *self.loading.values()]
            left = deadline - time.monotonic()
            if not inflight or left <= 0:
                raise TierFullError(
                    f"device tier full: {n} pages needed, {free} free, "
                    f"{table.used(DEVICE) - table.evictable(DEVICE)} pinned or in flight "
                    f"(capacity {table.capacity(DEVICE)} pages of {self.spec.page_bytes} B)"
                )
            # pages pinned only by copies in flight become evictable when those finish
            await asyncio.wait(
                [asyncio.shield(f) for f in inflight],
                timeout=left,
                return_when=asyncio.FIRST_COMPLETED,
            )
            free = table.capacity(DEVICE) - table.used(DEVICE)
            if free >= n:
                return
        keys = [k for k, _ in victims]
        wb = [(k, s) for k, s in victims if k in self.dirty or not self._has_lower(k)]
        if not wb:  # clean pages with a lower copy: drop them, no wait
            table.complete_evict(keys, DEVICE, ok=True)
            return
        task = asyncio.ensure_future(self._write_back(wb))
        try:
            await asyncio.shield(task)
        except BaseException:
            if not task.done():  # cancelled caller: the task finishes the eviction on its own
                task.add_done_callback(lambda t: self._end_evict(keys, t))
                raise
            table.complete_evict(keys, DEVICE, ok=False)
            raise
        table.complete_evict(keys, DEVICE, ok=True)
        self._clean(keys)

    def _end_evict(self, keys: list[Key], task: asyncio.Task[None]) -> None:
        ok = not task.cancelled() and task.exception() is None
        self.table.complete_evict(keys, DEVICE, ok=ok)
        if ok:
            self._clean(keys)

    def _has_lower(self, key: Key) -> bool:
        return any(self.table.lookup([key], t) for t in self.lower)

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
        owned = [k for k in alloc.keys if k in self.owners]
        if owned:
            table.prepare_load(owned, HOST)
        for k in stale_cold:  # the cold copy is older than the one just written
            if table.pins(k, COLD):
                table.complete_load([k], COLD)
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
        later costs no wait. Returns the pages written."""
        table = self.table
        pick = [
            k
            for k in dict.fromkeys(keys)
            if k in self.dirty and table.lookup([k], DEVICE) and k not in self.loading
        ]
        if not pick:
            return 0
        slots = table.prepare_load(pick, DEVICE)  # no eviction while the copy reads them
        gens = {k: self.dirty[k] for k in pick}
        task = asyncio.ensure_future(self._write_back(list(zip(pick, slots))))
        self._busy.add(task)
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._end_write_behind(pick, gens, task)
            else:
                task.add_done_callback(lambda t: self._end_write_behind(pick, gens, t))
        return len(pick)

    def _end_write_behind(
        self, keys: list[Key], gens: dict[Key, int], task: asyncio.Task[None]
    ) -> None:
        if task in self._busy:
            self._busy.discard(task)
            self.table.complete_load(keys, DEVICE)
            if not task.cancelled() and task.exception() is None:
                self._clean(keys, gens)  # a page written again meanwhile stays dirty

    def forget_in(self, tier: str, keys: Sequence[Key]) -> None:
        """Remove readable, unpinned pages from one tier."""
        here = [
            k
            for k in self.table.present(keys, tier)
            if self.table.state(k, tier) == PageState.READABLE and not self.table.pins(k, tier)
        ]
        if here:
            self.table.remove(here, tier)

    # -- host and cold -------------------------------------------------------------------
    async def _make_room_host(self, n: int) -> None:
        """Free ``n`` host slots: unowned victims are compressed into cold, or dropped."""
        table = self.table
        free = table.capacity(HOST) - table.used(HOST)
        if free >= n:
            return
        victims = cast(list[tuple[Key, int]], table.prepare_evict(HOST, n - free))
        if not victims:
            return  # prepare_store will report the tier as full
        keys = [k for k, _ in victims]
        ok = True
        try:
            if self.codec is not None:
                await self._compress(victims)
            else:
                self.stats.pages_dropped += len(keys)
        except TierFullError:
            self.stats.pages_dropped += len(keys)  # cold is full of owned pages: drop them
        except BaseException:
            ok = False
            raise
        finally:
            table.complete_evict(keys, HOST, ok=ok)

    async def _compress(self, victims: list[tuple[Key, int]]) -> None:
        """Encode host pages into cold slots (unowned cold pages are dropped for room)."""
        table = self.table
        codec, spec = self.codec, self.spec
        assert codec is not None
        keys = [k for k, _ in victims]
        alloc = table.prepare_store(keys, COLD)
        if alloc is None:
            raise TierFullError("cold tier full of owned pages")
        self.stats.pages_dropped += len(alloc.evicted)
        todo = [(k, s) for k, s in victims if k in set(alloc.keys)]
        host, cold = self.arenas[HOST], self.arenas[COLD]
        cold_of = dict(zip(alloc.keys, alloc.slots))

        def work() -> float:
            t0 = time.perf_counter()
            src = host.tensor.index_select(0, torch.tensor([s for _, s in todo]))
            enc = codec.encode(src, spec)
            cold.tensor.index_copy_(0, torch.tensor([cold_of[k] for k, _ in todo]), enc)
            return time.perf_counter() - t0

        try:
            self.stats.encode_s += await asyncio.to_thread(work)
        except BaseException:
            table.complete_store(alloc.keys, COLD, ok=False)
            raise
        table.complete_store(alloc.keys, COLD)
        owned = [k for k in alloc.keys if k in self.owners]
        if owned:
            table.prepare_load(owned, COLD)
        self.stats.pages_compressed += len(alloc.keys)

    async def compress_idle(self, keys: Sequence[Key]) -> int:
        """Compress these host pages (idle ones, chosen by the caller) into cold; returns count.

        Pages on the device, in flight, or pinned by anything but their owner are skipped.
        """
        if self.codec is None:
            return 0
        table = self.table
        pick: list[tuple[Key, int]] = []
        for k in keys:
            if table.present([k], DEVICE) or not table.lookup([k], HOST):
                continue
            if table.pins(k, HOST) != (1 if k in self.owners else 0):
                continue
            if table.present([k], COLD):
                continue
            pick.append((k, table.slot(k, HOST)))
        room = table.capacity(COLD) - table.used(COLD) + table.evictable(COLD)
        pick = pick[:room]
        if not pick:
            return 0
        pk = [k for k, _ in pick]
        table.prepare_load(pk, HOST)  # hold the sources while encoding
        try:
            await self._compress(pick)
        except TierFullError:
            return 0
        finally:
            table.complete_load(pk, HOST)
        moved = [k for k in pk if table.present([k], COLD)]
        for k in moved:
            if k in self.owners:
                table.complete_load([k], HOST)  # the owner's pin moved to the cold copy
        self.forget_in(HOST, moved)
        return len(moved)

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
