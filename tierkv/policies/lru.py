"""Least recently used.

Standalone, the policy keeps an ``OrderedDict`` of keys. Bound to a page table
(:meth:`LRUPolicy.bind_slots`) it keeps the order as an intrusive doubly linked list over the
tier's slots, two int lists with a sentinel at index ``capacity`` (as vLLM's
``FreeKVCacheBlockQueue``), so a use or an eviction never hashes a key::

    next:  H ──> s0 ──> s1 ──> ... ──> sk ──> H      H = capacity (the sentinel)
           least recent                 most recent
    prev[s] == -1: slot s is not in the list
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from tierkv.policies.base import (
    NO_HINT,
    CanEvict,
    CanEvictSlot,
    EvictionPolicy,
    Key,
    PageHint,
    unknown,
)

_UNLINKED = -1


class LRUPolicy(EvictionPolicy):
    """Evicts the page whose last use is oldest.

    Pages that may not be evicted are moved to the recent end as they are skipped, so a scan
    never revisits them: O(1) amortized. Once bound to a page table's slots, only the slot
    methods may be used (the key methods raise RuntimeError).
    """

    name = "lru"
    slot_aware = True

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._bound = False
        self._prev: list[int] = []
        self._next: list[int] = []
        self._head = 0  # the sentinel slot once bound
        self._n = 0  # slots in the list
        self._slot_of: Mapping[Key, int] = {}

    # -- keys (standalone) ---------------------------------------------------------------
    def _keys(self) -> OrderedDict[Key, None]:
        if self._bound:
            raise RuntimeError("this LRU policy is bound to a page table: use the slot methods")
        return self._order

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._keys()[key] = None

    def touch(self, key: Key) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Iterable[Key]) -> None:
        move = self._keys().move_to_end
        for k in keys:
            try:
                move(k)
            except KeyError:
                raise unknown(k, self.name) from None

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        order = self._keys()
        for k in reversed(keys):  # back to the least recent end, in victim order
            order[k] = None
            order.move_to_end(k, last=False)

    def candidates(self, n: int, can_evict: CanEvict | None = None) -> list[Key]:
        out: list[Key] = []
        if n <= 0:
            return out
        for k in self._keys():
            if can_evict is None or can_evict(k):
                out.append(k)
                if len(out) >= n:
                    break
        return out

    def insert_many(self, keys: Sequence[Key], hints: Sequence[PageHint]) -> None:
        self._keys().update(dict.fromkeys(keys))

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        order = self._keys()
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
        try:
            del self._keys()[key]
        except KeyError:
            raise unknown(key, self.name) from None

    def evict(self, can_evict: CanEvict) -> Key | None:
        order = self._keys()
        for _ in range(len(order)):
            key = next(iter(order))
            if can_evict(key):
                del order[key]
                return key
            order.move_to_end(key)
        return None

    def __len__(self) -> int:
        return self._n if self._bound else len(self._order)

    def __contains__(self, key: object) -> bool:
        if not self._bound:
            return key in self._order
        s = self._slot_of.get(key)
        return s is not None and self._prev[s] != _UNLINKED

    # -- slots (bound to a page table) ---------------------------------------------------
    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        if self._order or self._bound:
            raise RuntimeError("bind_slots needs a fresh LRU policy")
        self._bound = True
        self._slot_of = slot_of
        self._head = h = capacity
        self._prev = [_UNLINKED] * (capacity + 1)
        self._next = [_UNLINKED] * (capacity + 1)
        self._prev[h] = self._next[h] = h

    def insert_slots(
        self, slots: Sequence[int], keys: Sequence[Key], hints: Sequence[PageHint]
    ) -> None:
        prv, nxt, h = self._prev, self._next, self._head
        t = prv[h]
        for s in slots:
            nxt[t] = s
            prv[s] = t
            t = s
        nxt[t] = h
        prv[h] = t
        self._n += len(slots)

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        prv, nxt, h = self._prev, self._next, self._head
        t = prv[h]  # the tail; its own next link is stale until the end
        for s in slots:
            if s == t:
                continue
            p = prv[s]
            n = nxt[s]
            nxt[p] = n
            prv[n] = p
            nxt[t] = s
            prv[s] = t
            t = s
        nxt[t] = h
        prv[h] = t

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        prv, nxt = self._prev, self._next
        for s in slots:
            p = prv[s]
            n = nxt[s]
            nxt[p] = n
            prv[n] = p
            prv[s] = _UNLINKED
        self._n -= len(slots)

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        prv, nxt = self._prev, self._next
        p = self._head  # link after the sentinel, in victim order: the least recent end
        for s in slots:
            n = nxt[p]
            nxt[p] = s
            prv[s] = p
            nxt[s] = n
            prv[n] = s
            p = s
        self._n += len(slots)

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        nxt, h = self._next, self._head
        out: list[int] = []
        s = nxt[h]
        while s != h and len(out) < n:
            if can_evict is None or can_evict(s):
                out.append(s)
            s = nxt[s]
        return out

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        prv, nxt, h = self._prev, self._next, self._head
        out: list[int] = []
        if can_evict is None:  # every page may go: the n least recent
            s = nxt[h]
            for _ in range(min(n, self._n)):
                out.append(s)
                prv[s] = _UNLINKED
                s = nxt[s]
            nxt[h] = s
            prv[s] = h
            self._n -= len(out)
            return out
        skipped: list[int] = []
        s = nxt[h]
        for _ in range(self._n):  # each page is looked at once at most
            if len(out) >= n:
                break
            after = nxt[s]
            if can_evict(s):
                out.append(s)
                prv[s] = _UNLINKED
            else:
                skipped.append(s)
            s = after
        nxt[h] = s  # cut the scanned run off the front
        prv[s] = h
        self._n -= len(out) + len(skipped)
        if skipped:  # not evictable now: to the recent end
            self.insert_slots(skipped, (), ())
        return out
