"""KV-aware eviction: chain-aware GreedyDual on use counts, with conversation-shaped admission."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint

MAX_COUNT = 15
"""Use counts saturate here; the count is also the page's value class."""


@dataclass(slots=True)
class _Page:
    count: int  # uses, including those before it last left the tier; 0: an unseen last block
    prio: float
    parent: Key | None
    orphan: bool = False
    fanout: int = 0  # never-seen children that tried to extend this page


class KVAwarePolicy(EvictionPolicy):
    """GreedyDual on use counts, evicting stranded blocks first and admitting only chains
    that conversations come back to.

    Three ideas, each from how prefix-cached KV traffic behaves (see ``docs/policies.md``):

    * **Value by use count, aged by GreedyDual.** A page's priority is ``L + value(count)``
      where ``value(c) = c + 1`` (0 for a never-seen last block of a request, which is almost
      never reused) and ``L`` is the priority of the last victim. Counts survive eviction in a
      bounded history, so a page that comes back resumes its count. Counts take
      :data:`MAX_COUNT` values, and within one count class priorities rise with time, so one
      FIFO queue per class keeps them sorted: the victim is the lowest of 16 queue heads, O(1).
    * **Chains.** A block is only a hit while every block before it is resident. When a page
      is evicted its resident children become *orphans* and are evicted before anything else;
      a child whose parent was evicted here is an orphan on arrival; an orphan is restored when
      its parent comes back. This needs ``hint.parent``.
    * **Admission.** In a full tier a never-seen page is admitted only if it extends a resident
      page that no other new page has extended yet (a conversation's own chain, not a shared
      system prompt every first turn branches from), or if its request is short
      (``hint.blocks <= short_request``: short first turns are resumed about 0.43 of the time
      against 0.22 for long ones). A declined page is remembered, so the next request that
      brings it again (the conversation's second turn) stores it. Last blocks are declined.

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
        self._max_fanout = max_fanout
        self._short = short_request
        self._pages: dict[Key, _Page] = {}
        self._classes: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(MAX_COUNT + 1)]
        self._orphans: OrderedDict[Key, None] = OrderedDict()
        self._kids: dict[Key, set[Key]] = {}  # parent key -> resident children
        self._gone: OrderedDict[Key, int] = OrderedDict()  # departed/declined key -> count
        self._floor = 0.0  # GreedyDual's L

    @staticmethod
    def _value(count: int) -> float:
        return float(count + 1) if count else 0.0

    def _remember(self, key: Key, count: int) -> None:
        gone = self._gone
        gone[key] = count
        gone.move_to_end(key)
        limit = self._history * self._capacity
        while len(gone) > limit:
            gone.popitem(last=False)

    def _enqueue(self, key: Key, page: _Page) -> None:
        page.prio = self._floor + self._value(page.count)
        if page.orphan:
            self._orphans[key] = None
        else:
            self._classes[page.count][key] = None

    def _dequeue(self, key: Key, page: _Page) -> None:
        if page.orphan:
            del self._orphans[key]
        else:
            del self._classes[page.count][key]

    def _set_orphan(self, key: Key, orphan: bool) -> None:
        page = self._pages[key]
        if page.orphan != orphan:
            self._dequeue(key, page)
            page.orphan = orphan
            self._enqueue(key, page)

    def _detach(self, key: Key, evicted: bool) -> None:
        page = self._pages.pop(key)
        self._dequeue(key, page)
        if page.parent is not None:
            sibs = self._kids[page.parent]
            sibs.discard(key)
            if not sibs:
                del self._kids[page.parent]
        if evicted:
            for child in self._kids.get(key, ()):
                self._set_orphan(child, True)
        self._remember(key, page.count)

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        if key in self._gone:
            return True
        if hint.last:
            ok = False
        elif hint.parent is None:
            return True
        else:
            parent = self._pages.get(hint.parent)
            if parent is None:
                ok = False
            else:
                ok = parent.fanout < self._max_fanout or 0 < hint.blocks <= self._short
                parent.fanout += 1
        if not ok:
            self._remember(key, 1)
        return ok

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        seen = self._gone.pop(key, 0)
        count = 0 if hint.last and not seen else min(seen + 1, MAX_COUNT)
        page = _Page(count, 0.0, hint.parent)
        if hint.parent is not None:
            page.orphan = hint.parent not in self._pages and hint.parent in self._gone
            self._kids.setdefault(hint.parent, set()).add(key)
        self._pages[key] = page
        self._enqueue(key, page)
        for child in self._kids.get(key, ()):
            self._set_orphan(child, False)
        if not self._fixed and len(self._pages) > self._capacity:
            self._capacity = len(self._pages)

    def touch(self, key: Key) -> None:
        page = self._pages[key]
        self._dequeue(key, page)
        page.count = min(page.count + 1, MAX_COUNT)
        self._enqueue(key, page)

    def remove(self, key: Key) -> None:
        self._detach(key, evicted=False)

    def evict(self, can_evict: CanEvict) -> Key | None:
        orphans = self._orphans
        for _ in range(len(orphans)):
            key = next(iter(orphans))
            if can_evict(key):
                self._detach(key, evicted=True)
                return key
            orphans.move_to_end(key)
        best: Key | None = None
        best_prio = 0.0
        for queue in self._classes:
            for _ in range(len(queue)):
                key = next(iter(queue))
                if can_evict(key):
                    prio = self._pages[key].prio
                    if best is None or prio < best_prio:
                        best, best_prio = key, prio
                    break
                queue.move_to_end(key)
        if best is None:
            return None
        self._floor = best_prio
        self._detach(best, evicted=True)
        return best

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages
