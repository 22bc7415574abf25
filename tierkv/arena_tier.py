"""The tier core's arenas as `Tier`s (:mod:`tierkv.tier`): device, host and cold, each one
column of the page table over one arena of the core, so that a store's chain is a list of
`Tier` objects end to end (``TierSet.chain``: these, then the lower chain's, then the remote).

The page table stays the one owner of their state: slots, in-flight states and pins are its
records, and an `ArenaTier` reads and changes them through its public two-phase calls only
(``prepare_store`` / ``complete_store`` ...), as the core's collaborators do. Like every tier,
its bytes are read and written only by the moves registered for its medium (`Moves`: copies,
encodes and decodes, disk and remote moves), each one job of the transfer engine.

A column's *medium* is where its arena lives, the key of its moves: a host-first store's leased
column (the core's ``device``) is in pinned host memory, so its medium is ``host``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from functools import partial
from typing import Any, cast

from tierkv.core_context import CoreContext
from tierkv.keys import PageKey
from tierkv.page_table import StoreAllocation
from tierkv.runtime import Arena
from tierkv.tier import Holds
from tierkv.tier_names import COLD, DEVICE, HOST

__all__ = ["ArenaTier", "core_tiers"]


class ArenaTier:
    """One arena of the tier core as a `Tier`: column ``name`` of the page table, medium
    ``ctx.medium(name)``. Any page may be held (`Holds.ANY`).

    Args:
        ctx: the core's context: its arenas by column (read at each use: the page server may
            put the host column on shared memory), the page table, the media, the departures
            (told of pages leaving the host tier).
        name: the page table's column (``device``, ``host``, ``cold``).
        spare: of some of the column's pages, those whose copy here may be dropped with no
            byte lost (another exact copy holds them, and this one is not newer): what
            `make_room` frees.
    """

    holds = Holds.ANY

    def __init__(
        self, ctx: CoreContext, name: str, spare: Callable[[list[PageKey]], list[PageKey]]
    ) -> None:
        self.name, self.medium = name, ctx.medium(name)
        self._arenas, self._table, self._spare = ctx.arenas, ctx.table, spare
        self._left = ctx.departures.left if name == ctx.top else None

    @property
    def arena(self) -> Arena:
        """The column's arena (slot size, memory; its slots are the page table's)."""
        return self._arenas[self.name]

    def accepts(self, key: bytes) -> bool:
        """Any page."""
        return self.holds.accepts(key)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the column holds a readable copy (no I/O)."""
        ready = set(self._table.readable(keys, self.name))
        return [k in ready for k in keys]

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Every page (no admission filter)."""
        return [True] * len(keys)

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[PageKey, int]]:
        """Reserve a slot per key not held yet (WRITING: unreadable until committed); the
        policy drops unpinned pages for room (told to ``left``). Returns (key, slot) of each
        reservation, none for a key held already; [] when the column is full of pinned
        pages."""
        alloc: StoreAllocation | None = self._table.prepare_store(keys, self.name)
        if alloc is None:
            return []
        if alloc.evicted and self._left is not None:
            self._left(cast(list[PageKey], list(alloc.evicted)))
        return list(zip(cast(list[PageKey], list(alloc.keys)), alloc.slots, strict=True))

    def commit(self, reserved: Sequence[Any], ok: Sequence[bool]) -> None:
        """Make the reservations whose write succeeded readable; return the others' slots."""
        good = [k for (k, _), o in zip(reserved, ok, strict=True) if o]
        bad = [k for (k, _), o in zip(reserved, ok, strict=True) if not o]
        if good:
            self._table.complete_store(good, self.name)
        if bad:
            self._table.complete_store(bad, self.name, ok=False)

    def abort(self, reserved: Sequence[Any]) -> None:
        """Return reserved slots unused."""
        if reserved:
            self._table.complete_store([k for k, _ in reserved], self.name, ok=False)

    def free(self, keys: Sequence[bytes]) -> int:
        """Drop the readable, unpinned copies of ``keys`` here (a pinned or in-flight one
        stays); returns how many were dropped."""
        idle = cast(list[PageKey], self._table.idle(keys, self.name))
        if idle:
            self._table.remove(idle, self.name)
            if self._left is not None:
                self._left(idle)
        return len(idle)

    def make_room(self, n: int) -> int:
        """Free slots until ``n`` are free, by the policy's order, dropping only copies that
        ``spare`` allows (another exact copy holds the page); returns the pages freed. The
        core's own room (write-back, compression, offers to the tiers below) is made by its
        eviction; this frees what needs no move."""
        table, name = self._table, self.name
        short = n - (table.capacity(name) - table.used(name))
        if short <= 0:
            return 0
        victims = cast(list[tuple[PageKey, int]], table.prepare_evict(name, short))
        keys = [k for k, _ in victims]
        spare = set(self._spare(keys))
        go = [k for k in keys if k in spare]
        back = [k for k in keys if k not in spare]
        if back:
            table.complete_evict(back, name, ok=False)
        if go:
            table.complete_evict(go, name, ok=True)
            if self._left is not None:
                self._left(go)
        return len(go)

    def stats(self) -> dict[str, Any]:
        """Pages used, the capacity, the slot size and the medium."""
        t = self._table
        return {
            "medium": self.medium,
            "used": t.used(self.name),
            "capacity": t.capacity(self.name),
            "slot_bytes": self.arena.slot_bytes,
        }

    def close(self) -> None:
        """Nothing to release: the arena is the core's, freed with it (idempotent)."""


def core_tiers(ctx: CoreContext, dirty: Container[PageKey]) -> list[ArenaTier]:
    """The core's arenas as tiers, fastest first. A copy may be dropped for room (`make_room`)
    when an arena of exact bytes (device or host, not the lossy cold) holds the page readable
    too, and, on the device, the copy there is not newer (``dirty``: the write-back's set)."""
    table = ctx.table
    exact = [t for t in (DEVICE, HOST) if t in ctx.arenas]

    def spare(name: str, keys: list[PageKey]) -> list[PageKey]:
        others = [t for t in exact if t != name]
        got = cast(list[PageKey], table.readable(keys, others)) if others and keys else []
        return [k for k in got if k not in dirty] if name == DEVICE else got

    return [ArenaTier(ctx, t, partial(spare, t)) for t in (DEVICE, HOST, COLD) if t in ctx.arenas]
