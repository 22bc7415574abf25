"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tierkv.policies.base import NO_HINT, CanEvictSlot, EvictionPolicy, Hints, Key, PageHint
from tierkv.policies.history import History
from tierkv.policies.links import Links

_T1, _T2 = 0, 1  # the resident lists: queues of Links


class ARCPolicy(EvictionPolicy):
    """Balances recency against frequency with two resident lists and two ghost lists.

    ::

        T1 (seen once, resident)  | B1 (ghosts evicted from T1)
        T2 (seen twice+, resident) | B2 (ghosts evicted from T2)

    A page enters T1, or T2 if it is remembered in a ghost list; a use moves it to T2's MRU
    end. A ghost hit in B1 grows the target size ``p`` of T1, one in B2 shrinks it; eviction
    takes T1's LRU page while T1 exceeds ``p``, else T2's. Ghost lists are trimmed so that
    ``|T1| + |B1| <= c`` and all four lists hold at most ``2c`` keys.

    The page table asks for victims *before* inserting the pages that need the room; it calls
    :meth:`admit_many` first (when the tier is full), and a ghost hit adapts ``p`` there, so
    the victims are chosen as in the paper. A request for a page that is not resident
    (:meth:`miss`, which the page table calls for a touch of such a page) adapts ``p`` the same
    way, once per ghost until it is inserted. T1 and T2 are queues of slots; one
    :meth:`evict_slots` call takes its ``n`` victims in at most three scans (T1 while T1
    exceeds ``p``, then T2, then T1), as ``n`` calls for one victim each would choose them
    (``p`` does not move while evicting). Pinned pages are rotated to the MRU end of their list
    as they are skipped. Victims a caller chose (:meth:`evict_chosen`) leave from where they
    are, nothing else moved. A victim put back by :meth:`restore_slots` returns where it was
    (behind the page it was behind; the LRU end for one taken from there) and leaves its ghost
    list; ``p`` does not move.

    Args:
        capacity: pages the tier holds (``c``); ``None`` learns it as the high-water mark.
    """

    name = "arc"
    admits = True

    def __init__(self, capacity: int | None = None) -> None:
        self._c = capacity or 0
        self._fixed = capacity is not None
        self._p = 0.0
        self._links = Links(0, 2)
        self._key: list[Key] = []
        self._b1 = History()  # ghost keys, oldest first (their counts unused)
        self._b2 = History()
        self._adapted: Key | None = None  # the ghost key whose hit adapted p last
        self._fed: set[Key] = set()  # ghost keys whose hit already adapted p (not yet inserted)
        self._after: dict[int, int] = {}  # chosen victim -> the slot it was behind

    @property
    def target(self) -> float:
        """The current target size ``p`` of T1."""
        return self._p

    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        self._bind(capacity, slot_of)
        self._links = Links(capacity, 2)
        self._key = [None] * capacity

    def __len__(self) -> int:
        size = self._links.size
        return size[_T1] + size[_T2]

    def holds(self, s: int) -> bool:
        return self._links.linked(s)

    def _adapt(self, key: Key) -> None:
        if key in self._fed:
            return
        g1, g2 = self._b1.value, self._b2.value  # (the dicts: no method call per test)
        b1, b2 = len(g1), len(g2)
        if key in g1:
            self._p = min(float(self._c), self._p + max(1.0, b2 / b1))
        elif key in g2:
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
        else:
            return
        self._adapted = key
        if len(self._fed) > 2 * self._c + 64:  # missed ghosts that never came: forget them
            self._fed.clear()
        self._fed.add(key)

    def _adapt_many(self, keys: Iterable[Key]) -> None:
        """:meth:`_adapt` for each of ``keys`` in turn (the ghost lists do not change
        meanwhile), with its state in locals."""
        g1, g2, fed = self._b1.value, self._b2.value, self._fed
        if not (g1 or g2):
            return
        n1, n2 = len(g1), len(g2)
        p, c, adapted, most = self._p, float(self._c), self._adapted, 2 * self._c + 64
        for key in keys:
            if key in fed:
                continue
            if key in g1:
                p = min(c, p + max(1.0, n2 / n1))
            elif key in g2:
                p = max(0.0, p - max(1.0, n1 / n2))
            else:
                continue
            adapted = key
            if len(fed) > most:  # missed ghosts that never came: forget them
                fed.clear()
            fed.add(key)
        self._p, self._adapted = p, adapted

    def miss(self, keys: Iterable[Key]) -> None:
        self._adapt_many(keys)

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        self._adapt(key)
        return True

    def admit_many(self, keys: Sequence[Key], hints: Hints) -> list[bool] | None:
        self._adapt_many(keys)
        return None

    def insert_slots(self, slots: Sequence[int], keys: Sequence[Key], hints: Hints) -> None:
        links, key_of, b1, b2, fed = self._links, self._key, self._b1, self._b2, self._fed
        g1, g2 = b1.value, b2.value  # membership read from the dicts (no method call)
        t1, t2 = links.size[_T1], links.size[_T2]
        n1, n2 = len(g1), len(g2)  # ghosts, kept in step with the dicts
        c, fixed = self._c, self._fixed
        # Ghosts leave oldest first, one at a time as each page arrives; the pops are owed
        # (owe1, owe2) and paid by one trim before anything reads the ghosts again (a page
        # that is a ghost now, or the end): no pop in between can remove another key, so the
        # same keys leave. n1 and n2 count the ghosts as if each pop were paid at once.
        owe1 = owe2 = 0
        run: list[int] = []  # new T1 pages, appended in one call
        for s, k in zip(slots, keys):
            key_of[s] = k
            if k in g1 or k in g2:  # a ghost unless an owed pop took it: pay, and look again
                if owe1:
                    b1.trim(n1)
                    owe1 = 0
                if owe2:
                    b2.trim(n2)
                    owe2 = 0
                hit = k in g1 or k in g2
            else:
                hit = False
            if hit:  # remembered: straight to T2
                if k not in fed:
                    self._adapt(k)
                fed.discard(k)
                if k in g1:
                    b1.pop(k)
                    n1 -= 1
                else:
                    b2.pop(k)
                    n2 -= 1
                links.append(_T2, s)
                t2 += 1
            else:
                if fed:
                    fed.discard(k)
                run.append(s)
                t1 += 1
            resident = t1 + t2
            if not fixed and resident > c:
                c = self._c = resident
            if n1 and t1 + n1 > c:  # the oldest ghosts leave while |T1| + |B1| > c
                drop = min(n1, t1 + n1 - c)
                owe1 += drop
                n1 -= drop
            if n2 and resident + n1 + n2 > 2 * c:  # ... and while all four hold over 2c
                drop = min(n2, resident + n1 + n2 - 2 * c)
                owe2 += drop
                n2 -= drop
        if owe1:
            b1.trim(n1)
        if owe2:
            b2.trim(n2)
        if run:
            links.extend(_T1, run)
        if slots:  # an insert ends the adaptation its admission made (none: nothing ends)
            self._adapted = None

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._links.move_to_back(_T2, slots)

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._links.unlink_many(slots)

    def _from_t1(self, n: int) -> int:
        """How many of ``n`` victims T1 gives first: while ``|T1| > p`` (or, after a hit in
        B2, ``|T1| == int(p)``), the paper's REPLACE; ``p`` does not move while evicting."""
        in_b2 = self._adapted is not None and self._adapted in self._b2.value
        floor = int(self._p)
        lowest = max(floor, 1) if in_b2 else floor + 1  # T1 gives while |T1| >= lowest
        return max(0, min(n, self._links.size[_T1] - lowest + 1))

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        if self._after:
            self._after = {}
        links = self._links
        k1 = self._from_t1(n)
        first = links.take(_T1, k1, can_evict, True) if k1 else []
        second = links.take(_T2, n - len(first), can_evict, True) if len(first) < n else []
        third: list[int] = []
        got = len(first) + len(second)
        if got < n and len(first) == k1:  # T2 ran dry: T1 again (unless it ran dry first)
            third = links.take(_T1, n - got, can_evict, True)
        key_of = self._key
        b1, b2 = self._b1, self._b2
        if first:
            b1.put_many([key_of[s] for s in first], 0)
        if second:
            b2.put_many([key_of[s] for s in second], 0)
        if third:
            b1.put_many([key_of[s] for s in third], 0)
        return first + second + third if second or third else first

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        links = self._links
        k1 = self._from_t1(n)
        first = links.peek(_T1, k1, can_evict) if k1 else []
        second = links.peek(_T2, n - len(first), can_evict) if len(first) < n else []
        got = len(first) + len(second)
        if got < n and len(first) == k1:
            return first + second + links.peek(_T1, k1 + n - got, can_evict)[k1:]
        return first + second

    def evict_chosen(self, slots: Sequence[int]) -> list[int]:
        """Take ``slots`` from where they are in T1 / T2 (the default scan rotated the pages
        it passed to the MRU end), each key into its list's ghosts as an eviction puts it."""
        out = list(slots)
        queue, key_of = self._links.queue, self._key
        lists = [queue[s] for s in out]
        self._after = dict(zip(out, self._links.cut(out)))
        for s, which in zip(out, lists):
            (self._b1 if which == _T1 else self._b2).put(key_of[s], 0)
        return out

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        queue, after = self._links.queue, self._after  # (kept until the slot is reused)
        return [(queue[s], after.get(s, -1)) for s in slots]

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        links, key_of = self._links, self._key
        for s, k, state in zip(reversed(slots), reversed(keys), reversed(states)):
            assert isinstance(state, tuple)
            which, after = state
            (self._b1 if which == _T1 else self._b2).pop(k)
            key_of[s] = k  # a MOVING page may have been renamed
            links.put_after(_T1 if which == _T1 else _T2, s, after)
