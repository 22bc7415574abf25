"""Least frequently used, ties broken by least recent use."""

from __future__ import annotations

from collections import OrderedDict

from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint


class LFUPolicy(EvictionPolicy):
    """Evicts the page with the fewest uses; among equals, the least recently used.

    Pages live in one bucket per use count; the non-empty counts form a sorted doubly linked
    list, so a use moves a page to the next bucket in O(1) (Shah, Mitra & Matani, 2010).
    Pages that may not be evicted are moved to the recent end of their bucket as they are
    skipped: O(1) amortized, plus one step per pinned page passed over.

    Frequencies are counted from insertion: a page that leaves and comes back starts at 1.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        # Sorted linked list of the counts with a non-empty bucket; 0 is the sentinel head.
        self._next: dict[int, int] = {0: 0}
        self._prev: dict[int, int] = {0: 0}

    def _link_after(self, f: int, new: int) -> None:
        nxt = self._next[f]
        self._next[f] = new
        self._prev[new] = f
        self._next[new] = nxt
        self._prev[nxt] = new

    def _unlink(self, f: int) -> None:
        prv, nxt = self._prev.pop(f), self._next.pop(f)
        self._next[prv] = nxt
        self._prev[nxt] = prv
        del self._buckets[f]

    def _add(self, key: Key, f: int, after: int) -> None:
        bucket = self._buckets.get(f)
        if bucket is None:
            bucket = self._buckets[f] = OrderedDict()
            self._link_after(after, f)
        bucket[key] = None
        self._freq[key] = f

    def _drop(self, key: Key) -> int:
        """Remove ``key`` from its bucket; returns the count whose node precedes it now."""
        f = self._freq.pop(key)
        bucket = self._buckets[f]
        del bucket[key]
        if bucket:
            return f
        prv = self._prev[f]
        self._unlink(f)
        return prv

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._add(key, 1, 0)

    def touch(self, key: Key) -> None:
        f = self._freq[key]
        self._add(key, f + 1, self._drop(key))

    def remove(self, key: Key) -> None:
        self._drop(key)

    def evict(self, can_evict: CanEvict) -> Key | None:
        f = self._next[0]
        while f:
            bucket = self._buckets[f]
            nxt = self._next[f]
            for _ in range(len(bucket)):
                key = next(iter(bucket))
                if can_evict(key):
                    self._drop(key)
                    return key
                bucket.move_to_end(key)
            f = nxt
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
