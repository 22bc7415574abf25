"""The host and cold tiers: compression of idle or displaced host pages, and decoding back.

Host pages that no live sequence needs soon (idle for ``compress_after`` steps, or displaced when
the host tier fills) are encoded by the store's codec into the cold pool's smaller slots; a load
decodes them straight into a device slot on a worker thread. Part of
:class:`tierkv.tiers.TierSet`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from tierkv.codecs import Codec
from tierkv.errors import TierFullError
from tierkv.page_table import PageTable
from tierkv.runtime import Arena
from tierkv.spec import KVSpec
from tierkv.tier_stats import COLD, DEVICE, HOST, Key, TierStats


class ColdStorage:
    """Mixin of :class:`~tierkv.tiers.TierSet`: the host and cold tiers."""

    spec: KVSpec
    codec: Codec | None
    arenas: dict[str, Arena]
    table: PageTable
    owners: dict[Key, int]
    stats: TierStats
    owner_pinned: Callable[[Key, str], bool]
    forget_in: Callable[[str, Sequence[Key]], None]
    host_left: Callable[[Sequence[Hashable]], None]

    if TYPE_CHECKING:  # provided by TierSet

        async def offer_remote(self, victims: list[tuple[Key, int]]) -> None: ...

        def pin_owner(self, keys: Sequence[Key], tiers: Sequence[str]) -> None: ...

        def unpin_owner(self, key: Key, tier: str) -> None: ...

        def signal_progress(self) -> None: ...

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
            await self.offer_remote(victims)  # exact bytes, before they are compressed or gone
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
            if ok:
                self.host_left(keys)
            self.signal_progress()  # a lower copy in flight landed (or left)

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
        self.pin_owner([k for k in alloc.keys if k in self.owners], [COLD])
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
            if table.pins(k, HOST) != (1 if self.owner_pinned(k, HOST) else 0):
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
            await self.offer_remote(pick)
            await self._compress(pick)
        except TierFullError:
            return 0
        finally:
            table.complete_load(pk, HOST)
            self.signal_progress()
        moved = [k for k in pk if table.present([k], COLD)]
        for k in moved:
            self.unpin_owner(k, HOST)  # the owner's pin moved to the cold copy
        self.forget_in(HOST, moved)
        return len(moved)
