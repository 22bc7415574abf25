"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint


class LRUPolicy(EvictionPolicy):
    """Evicts the page whose last use is oldest.

    Pages that may not be evicted are moved to the recent end as they are skipped, so a scan
    never revisits them: O(1) amortized.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._order[key] = None

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[Key]) -> None:
        move = self._order.move_to_end
        for k in keys:
            move(k)

    def insert_many(self, keys: Sequence[Key], hints: Sequence[PageHint]) -> None:
        self._order.update(dict.fromkeys(keys))

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        order = self._order
        pop = order.popitem
        out: list[Key] = []
        skipped: list[Key] = []
        for _ in range(len(order)):
            if len(out) >= n:
                break
            key = pop(last=False)[0]
            if can_evict(key):
                out.append(key)
            else:
                skipped.append(key)
        order.update(dict.fromkeys(skipped))  # not evictable now: to the recent end
        return out

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, can_evict: CanEvict) -> Key | None:
        order = self._order
        for _ in range(len(order)):
            key = next(iter(order))
            if can_evict(key):
                del order[key]
                return key
            order.move_to_end(key)
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
