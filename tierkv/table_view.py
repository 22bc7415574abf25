"""A read-only view of the tier core's page table: where pages are, in which state, how full.

Everything outside the tier core (leases, prefetch, the remote glue, the page server, metrics,
tests) reads tier state through this view; only the core (:class:`tierkv.tiers.TierSet` and its
collaborators) holds the :class:`~tierkv.page_table.PageTable` itself and changes page state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from tierkv.keys import PageKey
from tierkv.page_table import PageState, PageTable

__all__ = ["TableView"]


class TableView:
    """Queries of one page table (no method of it changes anything)."""

    __slots__ = ("_table",)

    def __init__(self, table: PageTable) -> None:
        self._table = table

    @property
    def tier_names(self) -> list[str]:
        """The tiers, top (device) first."""
        return self._table.tier_names

    def capacity(self, tier: str) -> int:
        """Slots of ``tier``."""
        return self._table.capacity(tier)

    def used(self, tier: str) -> int:
        """Slots of ``tier`` holding a page (in any state)."""
        return self._table.used(tier)

    def evictable(self, tier: str) -> int:
        """Pages of ``tier`` that are readable and unpinned (could be evicted now)."""
        return self._table.evictable(tier)

    def tiers_of(self, key: PageKey) -> list[str]:
        """Tiers holding ``key`` (in any state)."""
        return self._table.tiers_of(key)

    def state(self, key: PageKey, tier: str) -> PageState:
        """State of ``key`` in ``tier``. Raises UnknownPageError."""
        return self._table.state(key, tier)

    def pins(self, key: PageKey, tier: str) -> int:
        """Pins on ``key`` in ``tier``. Raises UnknownPageError."""
        return self._table.pins(key, tier)

    def slot(self, key: PageKey, tier: str) -> int:
        """Slot of ``key`` in ``tier``. Raises UnknownPageError."""
        return self._table.slot(key, tier)

    def keys(self, tier: str) -> list[PageKey]:
        """Every page of ``tier`` (any state)."""
        return cast(list[PageKey], self._table.keys(tier))

    def lookup(self, keys: Sequence[PageKey], tier: str | None = None) -> int:
        """Length of the prefix of ``keys`` readable in ``tier`` (in some tier if None)."""
        return self._table.lookup(keys, tier)

    def present(self, keys: Iterable[PageKey], tier: str) -> list[PageKey]:
        """The keys of ``keys`` that ``tier`` holds (any state)."""
        return cast(list[PageKey], self._table.present(keys, tier))

    def readable(self, keys: Iterable[PageKey], tiers: str | Sequence[str]) -> list[PageKey]:
        """The keys of ``keys`` readable (not in flight) in ``tiers``: one tier, or at least one
        of several; in order."""
        return cast(list[PageKey], self._table.readable(keys, tiers))

    def held(self, keys: Iterable[PageKey]) -> list[PageKey]:
        """The keys of ``keys`` that some tier holds (any state), in order."""
        return cast(list[PageKey], self._table.held(keys))

    def sums(self, keys: Iterable[PageKey]) -> list[int]:
        """The checksum (CRC-32C of the raw page) of each key; ``NO_SUM`` (-1) where none."""
        return self._table.sums.get(keys)

    def quota_refusal(self, tier: str) -> tuple[bool, str | None]:
        """Whether the last eviction from ``tier`` that the tenants' quotas constrained found
        too few pages within them, and the tenant it was for (None: nobody's pages)."""
        return self._table.quota_blocked(tier), self._table.quota_refused(tier)

    def check(self) -> None:
        """The page table's invariants. Raises AssertionError."""
        self._table.check()
