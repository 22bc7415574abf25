"""Ownership, pins and renames of the tier core's pages.

A live sequence owns its pages (:class:`~tierkv.owners.Owners` counts the owners and pins their
lower copies once per page, so a page that a live sequence owns always has a copy somewhere).
A released sequence's private pages are forgotten: removed from every tier at once, or, when a
copy or a lease holds them now, *doomed* and removed as soon as they are idle (:meth:`reap`).
Its full blocks are renamed to their content keys, at once or once idle, so that a busy block
is cached, not freed.

A rename happens here only (:meth:`Ownership.rekey`: a publish, and the renames deferred until
a released block is idle) and reaches every per-page record: the page table and the owners
here; the dirty set and eviction's announced pages, the store's idle clock and the
prefetcher's record through the listeners they register (:meth:`Ownership.on_rename`). The one
other rename, the page server's fence of an expired write reservation
(:meth:`~tierkv.remote_glue.RemoteGlue.rename_reserved_host`), renames host slots still being
written: no other record holds such a page (not owned, dirty, leased nor prefetched). Part of
the tier core (:class:`tierkv.tiers.TierSet`), built from its
:class:`~tierkv.core_context.CoreContext`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

from tierkv.core_context import CoreContext
from tierkv.eviction import DeviceEviction
from tierkv.keys import PageKey
from tierkv.lower_tiers import ColdStorage
from tierkv.page_table import PageState

__all__ = ["Ownership", "Renamed"]

# told of a rename: (old keys, new keys), pairwise
Renamed = Callable[[Sequence[PageKey], Sequence[PageKey]], None]


class Ownership:
    """Who holds each page of one tier core, what goes when they let go, and renames."""

    def __init__(self, ctx: CoreContext, evict: DeviceEviction, cold: ColdStorage) -> None:
        self._table = ctx.table
        self._owners = ctx.owners
        self._evict = evict
        self._cold = cold
        self._doomed: set[PageKey] = set()  # released private pages still busy: removed when idle
        # released full blocks still busy (a write-behind copy reads them): renamed to their
        # content keys once idle, so that they are cached, not freed
        self._renames: list[tuple[list[PageKey], list[PageKey]]] = []
        self._listeners: list[Renamed] = []

    # -- read-only state -------------------------------------------------------------------
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
    def reap_pending(self) -> bool:
        """Whether :meth:`reap` has work: doomed pages, renames waiting, corrupt cold pages."""
        return bool(self._doomed or self._renames or self._cold.bad)

    # -- owning ----------------------------------------------------------------------------
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
        self._evict.clean(keys)
        self._doomed.update(k for k in keys if k not in self._owners)
        self.reap()

    def idle(self, key: PageKey) -> bool:
        """True when no copy of ``key`` is in flight or pinned by anything but its owners."""
        table = self._table
        for t in table.tiers_of(key):
            if table.state(key, t) != PageState.READABLE:
                return False
            if table.pins(key, t) != (1 if self._owners.holds_pin(key, t) else 0):
                return False
        return True

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
        self._evict.clean(doomed)  # a doomed page's device copy is never written back
        self._doomed = set(cast(list[PageKey], table.held(doomed)))

    def reap_turn(self) -> bool:
        """:meth:`reap`; True when it removed or renamed something (waiters may go on)."""
        before = len(self._doomed) + len(self._renames)
        self.reap()
        return len(self._doomed) + len(self._renames) < before

    # -- renames ---------------------------------------------------------------------------
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
                self._evict.clean(old)  # the block is cached under its content key: old goes
                self._doomed.update(old)
                continue
            if not self.rekey(old, new):
                left.append((old, new))
        self._renames = left

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
        for o, n in zip(old, new):
            self._owners.rename(o, n)
        for listener in self._listeners:
            listener(old, new)
        return True

    def on_rename(self, listener: Renamed) -> None:
        """Call ``listener(old, new)`` after every rename (the keys pairwise), so that a record
        kept per page elsewhere follows it: the dirty set and the announced pages
        (:class:`~tierkv.eviction.DeviceEviction`), the store's idle clock, the prefetcher's
        record. A listener must not fail (it runs inside the rename)."""
        self._listeners.append(listener)

    def check(self) -> None:
        """Assert this part's invariants: the owners'; doomed pages and pages to be renamed
        are unowned. Raises AssertionError."""
        self._owners.check()
        for k in self._doomed:
            assert k not in self._owners, f"doomed page {k.hex()} is owned"
        for old, _ in self._renames:
            for k in old:
                assert k not in self._owners, f"page {k.hex()} to be renamed is owned"
