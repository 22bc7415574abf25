"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03)."""

from __future__ import annotations

from collections import OrderedDict

from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint

_List = OrderedDict[Key, None]


class ARCPolicy(EvictionPolicy):
    """Balances recency against frequency with two resident lists and two ghost lists.

    ::

        T1 (seen once, resident)  | B1 (ghosts evicted from T1)
        T2 (seen twice+, resident) | B2 (ghosts evicted from T2)

    A page enters T1, or T2 if it is remembered in a ghost list; a use moves it to T2's MRU
    end. A ghost hit in B1 grows the target size ``p`` of T1, one in B2 shrinks it; eviction
    takes T1's LRU page while T1 exceeds ``p``, else T2's. Ghost lists are trimmed so that
    ``|T1| + |B1| <= c`` and all four lists hold at most ``2c`` keys.

    The page table asks for a victim *before* inserting the page that needs the room; when it
    calls :meth:`admit` first (it does when the tier is full), the ghost hit adapts ``p`` there,
    so the victim is chosen as in the paper. Pinned pages are rotated to the MRU end of their
    list as they are skipped; if one list has nothing evictable the other is used.

    Args:
        capacity: pages the tier holds (``c``); ``None`` learns it as the high-water mark.
    """

    name = "arc"

    def __init__(self, capacity: int | None = None) -> None:
        self._c = capacity or 0
        self._fixed = capacity is not None
        self._p = 0.0
        self._t1: _List = OrderedDict()
        self._t2: _List = OrderedDict()
        self._b1: _List = OrderedDict()
        self._b2: _List = OrderedDict()
        self._adapted: Key | None = None  # ghost key whose hit already adapted p (via admit)

    @property
    def target(self) -> float:
        """The current target size ``p`` of T1."""
        return self._p

    def _adapt(self, key: Key) -> None:
        if key == self._adapted:
            return
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(1.0, b2 / b1))
            self._adapted = key
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
            self._adapted = key

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        self._adapt(key)
        return True

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._adapt(key)
        self._adapted = None
        if key in self._b1:
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        resident = len(self._t1) + len(self._t2)
        if not self._fixed and resident > self._c:
            self._c = resident
        c = self._c
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and resident + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def touch(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    @staticmethod
    def _take(lst: _List, ghosts: _List, can_evict: CanEvict) -> Key | None:
        for _ in range(len(lst)):
            key = next(iter(lst))
            if can_evict(key):
                del lst[key]
                ghosts[key] = None
                return key
            lst.move_to_end(key)
        return None

    def evict(self, can_evict: CanEvict) -> Key | None:
        t1 = len(self._t1)
        in_b2 = self._adapted is not None and self._adapted in self._b2
        if t1 and (t1 > self._p or (in_b2 and t1 == int(self._p))):
            order = ((self._t1, self._b1), (self._t2, self._b2))
        else:
            order = ((self._t2, self._b2), (self._t1, self._b1))
        for lst, ghosts in order:
            key = self._take(lst, ghosts, can_evict)
            if key is not None:
                return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
