"""Least recently used, as one queue of slots (``links.py``): a use moves the page to the
tail, victims leave from the head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tierkv.policies.base import CanEvictSlot, EvictionPolicy, Hints, Key
from tierkv.policies.links import Links


class LRUPolicy(EvictionPolicy):
    """Evicts the page whose last use is oldest.

    Pages that may not be evicted are moved to the recent end as they are skipped, so a scan
    never revisits them: O(1) amortized.
    """

    name = "lru"

    def __init__(self) -> None:
        self._links = Links(0)

    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        self._bind(capacity, slot_of)
        self._links = Links(capacity)

    def __len__(self) -> int:
        return self._links.size[0]

    def holds(self, s: int) -> bool:
        return self._links.linked(s)

    def insert_slots(self, slots: Sequence[int], keys: Sequence[Key], hints: Hints) -> None:
        self._links.extend(0, slots)

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._links.move_to_back(0, slots)

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._links.unlink_many(slots)

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        self._links.extendleft(0, slots)  # the least recent end, in victim order

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        return self._links.peek(0, n, can_evict)

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        return self._links.take(0, n, can_evict)
