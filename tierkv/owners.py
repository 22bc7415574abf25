"""Owners of pages: how many live sequences hold each page, and the lower copies pinned for them.

A page a live sequence owns always has a copy somewhere: its copies in the lower tiers (host,
cold) are pinned on the owners' behalf, once per page whatever the number of owners, and the pin
is recorded (a bit per tier) so that only these pins, never a copy's transient one, go with the
last owner. Part of the tier core: only :class:`tierkv.tiers.TierSet` and its collaborators
call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tierkv.keys import PageKey
from tierkv.page_table import PageTable

__all__ = ["Owners"]


class Owners:
    """Owner counts and owners' pins over one page table."""

    def __init__(self, table: PageTable, lower: Sequence[str]) -> None:
        self._table = table
        self.lower = list(lower)
        self._count: dict[PageKey, int] = {}
        # a dict of ints is one the cyclic garbage collector never walks (a set per owned page
        # made its pauses long)
        self._pins: dict[PageKey, int] = {}
        self._bit = {t: 1 << i for i, t in enumerate(self.lower)}

    @property
    def counts(self) -> Mapping[PageKey, int]:
        """Owners per owned page (read-only)."""
        return self._count

    @property
    def pinned(self) -> Mapping[PageKey, int]:
        """Owned pages with owners' pins -> the tiers as bits (read-only)."""
        return self._pins

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def add(self, key: PageKey) -> bool:
        """One more owner of ``key``; True when it is the first (pin its lower copies then)."""
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        return n == 0

    def drop(self, key: PageKey) -> None:
        """One owner less; the last one takes the owners' pins with it."""
        n = self._count.get(key, 0)
        if n > 1:
            self._count[key] = n - 1
            return
        self._count.pop(key, None)
        held = self._pins.get(key, 0)
        for t, bit in self._bit.items():
            if held & bit:
                self.unpin(key, t)

    def pin(self, keys: Sequence[PageKey], tiers: Sequence[str]) -> None:
        """Pin the copies of ``keys`` (owned pages) in ``tiers`` on behalf of their owners."""
        for t in tiers:
            if keys:
                self._table.prepare_load(keys, t)
                pins, bit = self._pins, self._bit[t]
                for k in keys:
                    pins[k] = pins.get(k, 0) | bit

    def pin_lower(self, key: PageKey) -> None:
        """Pin every readable lower copy of a newly owned page."""
        self.pin([key], [t for t in self.lower if self._table.lookup([key], t)])

    def pin_owned(self, keys: Sequence[PageKey], tier: str) -> None:
        """Pin the new ``tier`` copies of those of ``keys`` that are owned."""
        self.pin([k for k in keys if k in self._count], [tier])

    def holds_pin(self, key: PageKey, tier: str) -> bool:
        """Whether the owners of ``key`` pin its copy in ``tier``."""
        return bool(self._pins.get(key, 0) & self._bit.get(tier, 0))

    def unpin(self, key: PageKey, tier: str) -> None:
        """Drop the owners' pin on ``key``'s copy in ``tier`` (if they hold one)."""
        held, bit = self._pins.get(key, 0), self._bit.get(tier, 0)
        if not held & bit:
            return
        if held == bit:
            del self._pins[key]
        else:
            self._pins[key] = held & ~bit
        if self._table.present([key], tier):
            self._table.complete_load([key], tier)

    def rename(self, old: PageKey, new: PageKey) -> None:
        """``old`` is now called ``new`` (its counts and pins follow)."""
        if old in self._count:
            self._count[new] = self._count.pop(old)
        if old in self._pins:
            self._pins[new] = self._pins.pop(old)

    def check(self) -> None:
        """Owned pages have a copy; owners' pins sit on copies that exist and are pinned.
        Raises AssertionError."""
        table = self._table
        for k, n in self._count.items():
            assert n > 0, f"page {k.hex()}: {n} owners"
            assert table.tiers_of(k), f"owned page {k.hex()} is in no tier"
        for k, bits in self._pins.items():
            assert k in self._count, f"unowned page {k.hex()} holds an owner's pin"
            for t, bit in self._bit.items():
                if bits & bit:
                    assert table.present([k], t), f"owner's pin on a missing {t} copy"
                    assert table.pins(k, t) >= 1, f"owner's pin on {k.hex()} in {t} lost"
