"""KV-aware eviction: chain-aware GreedyDual on use counts, with conversation-shaped admission."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint

MAX_COUNT = 15
"""Use counts saturate here; the count is also the page's value class."""

_VALUE = (0, 2, 5, *(2 * (c + 1) for c in range(3, MAX_COUNT + 1)))
"""GreedyDual value by use count, in half units: 0 for a never-seen last block, then 1, 2.5,
4, 5, ... (``count + 1`` from three uses on). Pages used once or twice are worth less than
``count + 1``: measured on the conversation trace, a once-used page reuses within 1,000
requests about as often as a twice-used one with one unit less to live (0.18 vs 0.20)."""

_ORPHAN = -1
_MASK = 63  # priority buckets: a power of two above max(_VALUE) + 1


@dataclass(slots=True)
class _Page:
    prio: int  # GreedyDual priority when queued (its bucket); _ORPHAN in the orphan queue
    code: int  # its use code (see KVAwarePolicy._count) when queued
    parent: Key | None
    fanout: int = 0  # never-seen children that tried to extend this page


class KVAwarePolicy(EvictionPolicy):
    """GreedyDual on use counts, evicting stranded blocks first and admitting only chains
    that conversations come back to.

    Three ideas, each from how prefix-cached KV traffic behaves (see ``docs/policies.md``):

    * **Value by use count, aged by GreedyDual.** A page's priority is ``L + value(count)``
      where ``value(c) = c + 1`` from three uses on, 1 and 2.5 for one and two uses (0 for
      a never-seen last block of a request, which is almost never reused) and ``L`` is the
      priority of the last victim. Counts survive eviction in a
      bounded history, so a page that comes back resumes its count. Counts take
      :data:`MAX_COUNT` values, and within one count class priorities rise with time, so one
      FIFO queue per class keeps them sorted: the victim is the lowest of 16 queue heads, O(1).
      A use only bumps the count (one dict store); the page moves to its new class, with the
      priority of that moment, when it reaches the head of its old queue (as CLOCK defers LRU).
    * **Chains.** A block is only a hit while every block before it is resident. When a page
      is evicted its resident children become *orphans* and are evicted before anything else;
      a child whose parent was evicted here is an orphan on arrival; an orphan is restored when
      its parent comes back. This needs ``hint.parent``.
    * **Admission.** In a full tier a never-seen page is admitted only if it extends a page
      (resident, or admitted in the same batch) that no other new page has extended yet (a
      conversation's own chain, not a shared system prompt every first turn branches from),
      or if its request is short (``hint.blocks <= short_request``: short first turns are
      resumed about 0.43 of the time against 0.22 for long ones). A declined page is
      remembered, so the next request that brings it again (the conversation's second turn)
      stores it. Last blocks are declined.

    Pages that may not be evicted are moved to the back of their queue as they are skipped
    (O(1) amortized, plus one step per pinned page passed over). Without ``hint.parent`` the
    policy admits every non-last page and runs as chain-blind GreedyDual.

    Args:
        capacity: pages the tier holds; ``None`` learns it as the high-water mark.
        history: remembered departed or declined pages, as a multiple of the capacity.
        max_fanout: never-seen children a page may admit before it counts as shared.
        short_request: requests of at most this many blocks are always admitted (0: none).
    """

    name = "kvaware"

    def __init__(
        self,
        capacity: int | None = None,
        history: float = 4.0,
        max_fanout: int = 1,
        short_request: int = 12,
    ) -> None:
        self._capacity = capacity or 0
        self._fixed = capacity is not None
        self._history = history
        self._limit = history * self._capacity
        self._max_fanout = max_fanout
        self._short = short_request
        # resident page -> use code: (L at its last use) * 16 + uses (0: an unseen last block)
        self._count: dict[Key, int] = {}
        self._pages: dict[Key, _Page] = {}
        # queued pages by priority, a ring: every queued priority lies in [L, L + 32] (half units)
        self._buckets: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(_MASK + 1)]
        self._orphans: OrderedDict[Key, None] = OrderedDict()
        self._kids: dict[Key, set[Key]] = {}  # parent key -> resident children
        self._gone: OrderedDict[Key, int] = OrderedDict()  # departed/declined key -> count
        self._pending: dict[Key, int] = {}  # admitted, not yet inserted -> fanout so far
        self._floor = 0  # GreedyDual's L: the priority of the last victim

    @staticmethod
    def _value(count: int) -> float:
        return _VALUE[count] / 2

    # -- bookkeeping ---------------------------------------------------------------------
    def _remember(self, key: Key, count: int) -> None:
        gone = self._gone
        gone[key] = count
        gone.move_to_end(key)
        if len(gone) > self._limit:
            pop = gone.popitem
            while len(gone) > self._limit:
                pop(last=False)

    def _enqueue(self, key: Key, page: _Page, orphan: bool = False) -> None:
        code = page.code = self._count[key]
        if orphan:
            page.prio = _ORPHAN
            self._orphans[key] = None
        else:
            page.prio = prio = (code >> 4) + _VALUE[code & 15]
            self._buckets[prio & _MASK][key] = None

    def _dequeue(self, key: Key, page: _Page) -> None:
        if page.prio == _ORPHAN:
            del self._orphans[key]
        else:
            del self._buckets[page.prio & _MASK][key]

    def _set_orphan(self, key: Key, orphan: bool) -> None:
        page = self._pages[key]
        if (page.prio == _ORPHAN) != orphan:
            self._dequeue(key, page)
            if not orphan:  # restored: its priority counts from now
                self._count[key] = (self._floor << 4) + (self._count[key] & 15)
            self._enqueue(key, page, orphan)

    def _detach(self, key: Key, evicted: bool) -> None:
        page = self._pages.pop(key)
        count = self._count.pop(key) & 15
        self._dequeue(key, page)
        if page.parent is not None:
            sibs = self._kids[page.parent]
            sibs.discard(key)
            if not sibs:
                del self._kids[page.parent]
        if evicted:
            for child in self._kids.get(key, ()):
                self._set_orphan(child, True)
        self._remember(key, count)

    # -- the interface -------------------------------------------------------------------
    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        ok = self._admit(key, hint)
        if ok and hint is not NO_HINT:  # a later page of the batch may extend it
            self._pending.setdefault(key, 0)
        return ok

    def _admit(self, key: Key, hint: PageHint) -> bool:
        if key in self._gone:
            return True
        if hint.last:
            ok = False
        elif hint.parent is None:
            return True
        else:
            parent = self._pages.get(hint.parent)
            if parent is not None:
                ok = parent.fanout < self._max_fanout or 0 < hint.blocks <= self._short
                parent.fanout += 1
            else:
                fanout = self._pending.get(hint.parent)  # admitted earlier in this batch
                if fanout is None:
                    ok = False
                else:
                    ok = fanout < self._max_fanout or 0 < hint.blocks <= self._short
                    self._pending[hint.parent] = fanout + 1
        if not ok:
            self._remember(key, 1)
        return ok

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        seen = self._gone.pop(key, 0)
        count = 0 if hint.last and not seen else min(seen + 1, MAX_COUNT)
        parent = hint.parent
        page = _Page(0, 0, parent, self._pending.pop(key, 0))
        self._pages[key] = page
        self._count[key] = (self._floor << 4) + count
        if parent is not None:
            orphan = parent not in self._pages and parent in self._gone
            self._enqueue(key, page, orphan)
            kids = self._kids.get(parent)
            if kids is None:
                self._kids[parent] = {key}
            else:
                kids.add(key)
        else:
            self._enqueue(key, page)
        kids = self._kids.get(key)
        if kids:
            for child in kids:
                self._set_orphan(child, False)
        if not self._fixed and len(self._pages) > self._capacity:
            self._capacity = len(self._pages)
            self._limit = self._history * self._capacity

    def insert_many(self, keys: Sequence[Key], hints: Sequence[PageHint]) -> None:
        gone, pages, count, buckets = self._gone, self._pages, self._count, self._buckets
        insert, pending, value = self.insert, self._pending, _VALUE
        floor = self._floor
        base = floor << 4
        for k, h in zip(keys, hints):
            if h.parent is not None or self._kids:
                insert(k, h)
                floor = self._floor
                base = floor << 4
                continue
            seen = gone.pop(k, 0) if gone else 0  # a chain-blind page: the short way
            c = 0 if h.last and not seen else min(seen + 1, MAX_COUNT)
            code = count[k] = base + c
            p = floor + value[c]
            pages[k] = _Page(p, code, None, pending.pop(k, 0) if pending else 0)
            buckets[p & _MASK][k] = None
        self._pending.clear()
        if not self._fixed and len(pages) > self._capacity:
            self._capacity = len(pages)
            self._limit = self._history * self._capacity

    def touch(self, key: Key) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Iterable[Key]) -> None:
        count = self._count
        now = self._floor << 4
        for k in keys:
            c = count[k] & 15
            count[k] = now + (c + 1 if c < MAX_COUNT else c)

    def remove(self, key: Key) -> None:
        self._detach(key, evicted=False)

    def evict(self, can_evict: CanEvict) -> Key | None:
        out = self.evict_many(1, can_evict)
        return out[0] if out else None

    def _evict_orphans(self, n: int, can_evict: CanEvict, out: list[Key]) -> None:
        orphans = self._orphans
        for _ in range(len(orphans)):  # each unevictable one is passed over once
            if len(out) >= n or not orphans:
                return
            key = orphans.popitem(last=False)[0]
            orphans[key] = None
            if can_evict(key):
                self._detach(key, evicted=True)
                out.append(key)

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        out: list[Key] = []
        orphans = self._orphans
        if orphans:  # stranded blocks first, oldest first
            self._evict_orphans(n, can_evict, out)
        buckets, pages, count, kids = self._buckets, self._pages, self._count, self._kids
        gone, limit = self._gone, self._limit
        prio = self._floor
        top = prio + _VALUE[MAX_COUNT] + 2  # every queued priority is below this (ring of 64)
        skips: dict[int, int] = {}  # bucket -> unevictable pages still to pass over this call
        while len(out) < n:
            q = buckets[prio & _MASK]
            if not q or (skips and skips.get(prio, 1) <= 0):
                prio += 1
                if prio >= top:
                    break
                continue
            key = q.popitem(last=False)[0]
            page = pages[key]
            code = count[key]
            if code != page.code:  # used since it was queued: to its bucket now
                page.code = code
                p = page.prio = (code >> 4) + _VALUE[code & 15]
                buckets[p & _MASK][key] = None
            elif can_evict(key):
                self._floor = prio
                del pages[key], count[key]
                parent = page.parent
                if parent is not None:
                    sibs = kids[parent]
                    sibs.discard(key)
                    if not sibs:
                        del kids[parent]
                    mine = kids.get(key)
                    if mine:
                        for child in mine:
                            self._set_orphan(child, True)
                elif kids:
                    mine = kids.get(key)
                    if mine:
                        for child in mine:
                            self._set_orphan(child, True)
                gone[key] = code & 15
                if len(gone) > limit:
                    gone.popitem(last=False)
                out.append(key)
                if orphans:  # the victim's children, now stranded, go next
                    self._evict_orphans(n, can_evict, out)
            else:
                q[key] = None  # to the back of its queue
                skips[prio] = skips.get(prio, len(q)) - 1
        return out

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages
