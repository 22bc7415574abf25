"""Least recently used, as one queue of slots (``links.py``): a use moves the page to the
tail, victims leave from the head (or, chosen by the caller, from where they are)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tierkv.policies.base import CanEvictSlot, EvictionPolicy, Hints, Key
from tierkv.policies.links import Links


class LRUPolicy(EvictionPolicy):
    """Evicts the page whose last use is oldest.

    Pages that may not be evicted are moved to the recent end as they are skipped, so a scan
    never revisits them: O(1) amortized. Victims a caller chose (:meth:`evict_chosen`) leave
    from where they are, no other page moved; put back (:meth:`restore_slots`), each returns
    behind the page it was behind, so it keeps its recency.
    """

    name = "lru"

    def __init__(self) -> None:
        self._links = Links(0)
        self._after: dict[int, int] = {}  # chosen victim -> the slot it was behind

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

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        after = self._after  # (empty unless evict_chosen took them: each was at the head)
        return [after.get(s, -1) for s in slots] if after else [-1] * len(slots)

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        links = self._links
        for s, after in zip(reversed(slots), reversed(states)):
            links.put_after(0, s, after if isinstance(after, int) else -1)

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        return self._links.peek(0, n, can_evict)

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        if self._after:
            self._after = {}
        return self._links.take(0, n, can_evict)

    def evict_chosen(self, slots: Sequence[int]) -> list[int]:
        """Take ``slots`` from where they are (the default scan moved every page ahead of
        them to the recent end: cold pages outranked hot ones after it)."""
        out = list(slots)
        self._after = dict(zip(out, self._links.cut(out)))
        return out
