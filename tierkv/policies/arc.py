"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from tierkv.policies.base import NO_HINT, CanEvict, Key, OneByOne, PageHint, unknown

_List = OrderedDict[Key, None]


class ARCPolicy(OneByOne):
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
    so the victim is chosen as in the paper. A request for a page that is not resident
    (:meth:`miss`, which the page table calls for a touch of such a page) adapts ``p`` the same
    way, once per ghost until it is inserted. Pinned pages are rotated to the MRU end of their
    list as they are skipped; if one list has nothing evictable the other is used. A victim
    put back by :meth:`restore` returns to the LRU end of its list and leaves its ghost list;
    ``p`` does not move.

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
        self._adapted: Key | None = None  # the ghost key whose hit adapted p last
        self._fed: set[Key] = set()  # ghost keys whose hit already adapted p (not yet inserted)
        self._recent: dict[Key, object] = {}  # the last eviction call's victims -> 1 (T1) or 2

    @property
    def target(self) -> float:
        """The current target size ``p`` of T1."""
        return self._p

    def _adapt(self, key: Key) -> None:
        if key in self._fed:
            return
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(1.0, b2 / b1))
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
        else:
            return
        self._adapted = key
        if len(self._fed) > 2 * self._c + 64:  # missed ghosts that never came: forget them
            self._fed.clear()
        self._fed.add(key)

    def miss(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self._adapt(k)

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        self._adapt(key)
        return True

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._adapt(key)
        self._adapted = None
        self._fed.discard(key)
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
        elif key in self._t2:
            self._t2.move_to_end(key)
        else:
            raise unknown(key, self.name)

    def remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
        elif key in self._t2:
            del self._t2[key]
        else:
            raise unknown(key, self.name)

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        for k, which in zip(reversed(keys), reversed(states)):
            lst, ghosts = (self._t1, self._b1) if which == 1 else (self._t2, self._b2)
            ghosts.pop(k, None)
            lst[k] = None
            lst.move_to_end(k, last=False)

    def _order(self, t1: int) -> bool:
        """Whether the next victim comes from T1 first (T1 holding ``t1`` pages)."""
        in_b2 = self._adapted is not None and self._adapted in self._b2
        return bool(t1) and (t1 > self._p or (in_b2 and t1 == int(self._p)))

    def candidates(self, n: int, can_evict: CanEvict | None = None) -> list[Key]:
        ok = can_evict or (lambda k: True)

        def runs(lst: _List) -> Iterator[Key]:
            return (k for k in lst if ok(k))

        first, second = runs(self._t1), runs(self._t2)
        out: list[Key] = []
        t1 = len(self._t1)
        while len(out) < n:
            from_t1 = self._order(t1)
            a, b = (first, second) if from_t1 else (second, first)
            k = next(a, None)
            took_t1 = from_t1
            if k is None:
                k = next(b, None)
                took_t1 = not from_t1
            if k is None:
                break
            out.append(k)
            t1 -= took_t1
        return out

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

    def _evict_one(self, can_evict: CanEvict) -> Key | None:
        if self._order(len(self._t1)):
            order = ((self._t1, self._b1, 1), (self._t2, self._b2, 2))
        else:
            order = ((self._t2, self._b2, 2), (self._t1, self._b1, 1))
        for lst, ghosts, which in order:
            key = self._take(lst, ghosts, can_evict)
            if key is not None:
                self._recent[key] = which
                return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
