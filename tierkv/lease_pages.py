"""The device pages as a compute lease reads and writes them.

Attention views (a slot as a page, slots gathered token-major: zero-copy or one copy), the
writes of an append (zeroed slots, pages marked dirty, the checksums of filled pages sealed), a
step group's pages pinned and its new pages' slots taken with no wait (where the core can),
the write-behind a lease's end asks for and the policy's recency. Part of the tier core
(:class:`tierkv.tiers.TierSet`), built from its :class:`~tierkv.core_context.CoreContext`:
page state changes only through the core's page table and :class:`~tierkv.eviction.DeviceEviction`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import torch

from tierkv import page_sums
from tierkv.core_context import CoreContext
from tierkv.device_loads import DeviceLoads
from tierkv.eviction import DeviceEviction
from tierkv.keys import PageKey
from tierkv.page_sums import row_sums
from tierkv.runtime import Arena, Priority
from tierkv.spec import KVSpec
from tierkv.tier_names import DEVICE

__all__ = ["LeasePages"]

_NO_INDEX = torch.empty(0, dtype=torch.int64)


class LeasePages:
    """Views and writes of one tier core's device pages, for its leases."""

    def __init__(self, ctx: CoreContext, evict: DeviceEviction, loads: DeviceLoads) -> None:
        self._loads = loads
        self._spec = ctx.spec
        self._table = ctx.table
        self._evict = evict
        self._owners = ctx.owners
        self._arena = ctx.arenas[DEVICE]
        self._pages = _page_views(ctx.spec, self._arena)
        self._by_head = self._pages.permute(1, 2, 0, 3, 4)  # [2, H, slots, T, D]: a view

    def acquire_now(self, keys: Sequence[PageKey], priority: Priority) -> int | None:
        """Pin a step group's pages with no wait, loading what is not resident where that
        needs none; the pages loaded, or None with nothing pinned (then
        ``TierSet.acquire_device``): :meth:`tierkv.device_loads.DeviceLoads.acquire_now`."""
        return self._loads.acquire_now(keys, priority)

    def reserve_now(self, keys: Sequence[PageKey]) -> list[int] | None:
        """Slots for a step group's new pages with no wait, or None with nothing reserved
        (then ``TierSet.reserve_device``): :meth:`tierkv.device_loads.DeviceLoads.reserve_now`."""
        return self._loads.reserve_now(keys)

    @property
    def device(self) -> torch.device:
        """The torch device of the device tier's pages."""
        return self._pages.device

    @property
    def all_pages(self) -> torch.Tensor:
        """Every device slot as a page: ``[slots, 2, H, T, D]`` in the KV dtype (a view; the
        step path reads and writes pinned slots through it, :mod:`tierkv.step`)."""
        return self._pages

    @property
    def dirty(self) -> Mapping[PageKey, int]:
        """Device pages newer than their lower copies (read-only)."""
        return self._evict.dirty

    @property
    def write_behind_pinned(self) -> int:
        """Device pages pinned by write-behind copies now."""
        return self._evict.write_behind_pinned

    # -- views -------------------------------------------------------------------------------
    def page(self, slot: int) -> torch.Tensor:
        """A device slot viewed as a page ``[2, H, T, D]`` (zero-copy)."""
        return self._pages[slot]

    def gather_tokens(self, slots: Sequence[int]) -> torch.Tensor:
        """Device slots gathered token-major: ``[2, H, n * T, D]`` (K then V; one copy, the
        layout attention reads, with no second copy to reorder it)."""
        n = len(slots)
        _, h, t, d = self._spec.page_shape
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
        table, owners = self._table, self._owners
        return any(
            table.pins(k, DEVICE) > owners.holds_pin(k, DEVICE)  # (the owners' pin: top=DEVICE)
            for k in cast(list[PageKey], table.present(keys, DEVICE))
        )

    def touch_device(self, keys: Iterable[PageKey]) -> None:
        """Mark readable device pages as just used (the policy's recency)."""
        here = self._table.readable(keys, DEVICE)
        if here:
            self._table.touch(here, DEVICE)

    # -- writes ------------------------------------------------------------------------------
    def zero_device(self, slots: Sequence[int]) -> None:
        """Zero device slots (new pages start clean, whatever the slot held before)."""
        arena = self._arena
        for s in slots:  # a handful of pages: a memset each (index_fill_ scans the whole arena)
            arena.slot_view(s).zero_()

    def mark_dirty(self, keys: Sequence[PageKey]) -> None:
        """Device copies of ``keys`` were written: newer than any lower copy."""
        self._evict.mark_dirty(keys)

    def seal(self, keys: Sequence[PageKey]) -> None:
        """Device pages whose content is final (an append filled them): record the CRC-32C of
        their bytes, in one native call. Where the device is not host memory (CUDA) the bytes
        are not read back: those pages get theirs when first published
        (:meth:`tierkv.remote_glue.RemoteGlue.host_sums`)."""
        if keys and self._pages.device.type == "cpu" and page_sums.enabled():
            slots = self._table.slots(keys, DEVICE)
            self._table.sums.set(keys, row_sums(self._arena.array, slots))

    async def write_behind(self, keys: Sequence[PageKey]) -> int:
        """Copy dirty device pages of ``keys`` down to the host now; returns pages written
        (see :meth:`tierkv.eviction.DeviceEviction.write_behind`)."""
        return await self._evict.write_behind(keys)


def _page_views(spec: KVSpec, arena: Arena) -> torch.Tensor:
    """Every device slot as a page ``[2, H, T, D]`` in the KV dtype, without copies."""
    raw = arena.tensor[:, : 2 * spec.kv_bytes]
    return raw.view(spec.dtype).view(arena.num_slots, *spec.page_shape)
