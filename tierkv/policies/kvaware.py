"""KV-aware eviction: chain-aware GreedyDual on use counts, with conversation-shaped admission.

The file stays whole (over 400 lines): the same rules run over keys and over a page table's
slots, side by side, so that a reader (and the test that runs both) can check one against the
other; its admission rules live in ``kvaware_admission.py``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from tierkv.policies.base import (
    NO_HINT,
    CanEvict,
    CanEvictSlot,
    EvictionPolicy,
    Key,
    PageHint,
    unknown,
)
from tierkv.policies.kvaware_admission import (
    HEAD_PER_PAGES,
    SCAN_WARMUP,
    STEP_BLOCKS,
    STEP_PER_PAGES,
    ConversationAdmission,
)

__all__ = [
    "HEAD_PER_PAGES",
    "MAX_COUNT",
    "SCAN_WARMUP",
    "STEP_BLOCKS",
    "STEP_PER_PAGES",
    "KVAwarePolicy",
]

MAX_COUNT = 15
"""Use counts saturate here; the count is also the page's value class."""

_VALUE = (0, 2, 5, *(2 * (c + 1) for c in range(3, MAX_COUNT + 1)))
"""GreedyDual value by use count, in half units: 0 for a never-seen last block, then 1, 2.5,
4, 5, ... (``count + 1`` from three uses on). Pages used once or twice are worth less than
``count + 1``: measured on the conversation trace, a once-used page reuses within 1,000
requests about as often as a twice-used one with one unit less to live (0.18 vs 0.20)."""

_ORPHAN = -1
_MASK = 63  # priority buckets: a power of two above max(_VALUE) + 1
# Laps: a page passed over while unevictable ends up below the floor once a page above it is
# evicted (so does a victim put back by restore), in any bucket of the ring. A scan therefore goes
# round the whole ring of 64 buckets, lap after lap while a lap still evicts or moves a page, and
# stops early only when it has its n victims.
_ORPHANS = _MASK + 1  # slot mode: the orphan queue's index after the buckets'
_UNLINKED = -1  # slot mode: ``_prev[s]`` of a slot the policy does not hold


@dataclass(slots=True)
class _Page:
    prio: int  # GreedyDual priority when queued (its bucket); _ORPHAN in the orphan queue
    code: int  # its use code (see KVAwarePolicy._count) when queued
    parent: Key | None
    fanout: int = 0  # never-seen children that tried to extend this page
    back: int = -1  # its use code when it came back from the history; -1: it did not


class KVAwarePolicy(ConversationAdmission, EvictionPolicy):
    """GreedyDual on use counts, evicting stranded blocks first and admitting only chains
    that conversations come back to.

    The ideas, each from how prefix-cached KV traffic behaves (see ``docs/policies.md``):

    * **Value by use count, aged by GreedyDual.** A page's priority is ``L + value(count)``
      where ``value(c) = c + 1`` from three uses on, 1 and 2.5 for one and two uses (0 for
      a never-seen last block of a request, which is almost never reused) and ``L`` is the
      priority of the last victim. Counts survive eviction in a bounded history, so a page
      that comes back resumes its count. Priorities are integers in half units and every
      queued one lies in ``[L, L + 32]``, so the pages sit in a ring of 64 FIFO buckets by
      priority and the victim is the head of the lowest non-empty bucket, O(1). A use only
      rewrites the page's use code (one store); the page moves to its new bucket, with the
      priority of that moment, when it reaches the head of its old one (as CLOCK defers LRU).
    * **Chains.** A block is only a hit while every block before it is resident. When a page
      is evicted its resident children become *orphans* and are evicted before anything else;
      a child whose parent was evicted here is an orphan on arrival; an orphan is restored when
      its parent comes back. This needs ``hint.parent``.
    * **Admission.** In a full tier a never-seen page is admitted only if it extends a page
      (resident, or admitted in the same batch) that no other new page has extended yet (a
      conversation's own chain, not a shared system prompt every first turn branches from),
      or if its request is short (``hint.blocks <= short_request``: short first turns are
      resumed about 0.43 of the time against 0.22 for long ones; the step rule and the scan
      gate below still apply). A declined page is
      remembered, so the next request that brings it again (the conversation's second turn)
      stores it. Last blocks are declined. The first ``head_blocks`` of a declined first turn
      are admitted all the same, so a conversation that resumes finds its head resident.
    * **Steps.** A later turn of a conversation (a request that hit past the shared root) that
      brings ``step_blocks`` or more never-seen blocks in a row (a pasted document) is declined
      from there on: such blocks come back 5-20% of the time. The never-seen blocks of a
      smaller step come back about half the time, as often as a twice-used page, and start
      with a use count of 2.
    * **Scans.** A page that comes back from the history is admitted, unless such pages have
      stopped being used before they leave (a loop longer than the tier): then the history is
      a scan's, and it is only sampled (see :data:`SCAN_WARMUP`).

    Pages that may not be evicted are moved to the back of their queue as they are skipped
    (O(1) amortized, plus one step per pinned page passed over). Bound to a page table
    (:meth:`bind_slots`) the policy keeps its per-page state in per-slot lists and decides
    exactly as with keys; its key methods then raise RuntimeError (``admit`` works in both).
    With no hint at all (``NO_HINT``, as ``KVStore`` passes) the policy admits every page and
    runs as chain-blind GreedyDual; a hint without ``parent`` still goes through the head rule
    and the scan gate.

    Args:
        capacity: pages the tier holds; ``None`` learns it as the high-water mark.
        history: remembered departed or declined pages, as a multiple of the capacity.
        max_fanout: never-seen children a page may admit before it counts as shared.
        short_request: requests of at most this many blocks are always admitted (0: none).
        head_blocks: leading blocks of a declined first turn that are admitted anyway; ``None``
            scales it with the capacity (one per :data:`HEAD_PER_PAGES` pages; 0: none).
        step_blocks: never-seen blocks in a row from which a later turn is declined; ``None``
            scales it with the capacity (see :data:`STEP_PER_PAGES`; 0: no step rule, and
            small steps start at one use like any new page).
    """

    name = "kvaware"
    slot_aware = True

    def __init__(
        self,
        capacity: int | None = None,
        history: float = 4.0,
        max_fanout: int = 1,
        short_request: int = 12,
        head_blocks: int | None = None,
        step_blocks: int | None = None,
    ) -> None:
        self._capacity = capacity or 0
        self._fixed = capacity is not None
        self._history = history
        self._limit = history * self._capacity
        self._max_fanout = max_fanout
        self._short = short_request
        self._head_blocks = head_blocks
        self._step_blocks = step_blocks
        self._run: dict[Key, int] = {}  # this batch's never-seen pages -> depth their run began
        self._small: set[Key] = set()  # this batch's admitted small-step pages: start at 2 uses
        # the scan gate: pages back from the history that left (decayed), of them used; counts
        self._back_left = self._back_used = 0.0
        self._back_seen = self._probes = 0
        self._decisions: dict[str, int] = {}
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
        self._recent: dict[Key, tuple[_Page, int]] = {}  # key mode: last call's victims
        # slot mode (see bind_slots); empty until bound
        self._bound = False
        self._slot_of: Mapping[Key, int] = {}
        self._n = 0
        self._head = self._orph = 0
        self._prev: list[int] = []
        self._next: list[int] = []
        self._qlen: list[int] = []
        self._where: list[int] = []
        self._code: list[int] = []
        self._qcode: list[int] = []
        self._key: list[Key] = []
        self._parent: list[Key | None] = []
        self._fanout: list[int] = []
        self._back: list[int] = []  # slot mode: _Page.back
        self._bump: list[int] = []  # see _tables
        self._start: list[int] = []
        self._start_prio: list[int] = []
        self._tables_floor = -1

    @staticmethod
    def _value(count: int) -> float:
        return _VALUE[count] / 2

    # -- bookkeeping ---------------------------------------------------------------------
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

    def _set_orphan(self, key: Key, orphan: bool, reset: bool = True) -> None:
        page = self._pages[key]
        if (page.prio == _ORPHAN) != orphan:
            self._dequeue(key, page)
            if not orphan and reset:  # restored: its priority counts from now
                self._count[key] = (self._floor << 4) + (self._count[key] & 15)
            self._enqueue(key, page, orphan)

    def _detach(self, key: Key, evicted: bool) -> None:
        page = self._pages.pop(key)
        code = self._count.pop(key)
        if evicted:
            self._recent[key] = (page, code)
        count = code & 15
        self._dequeue(key, page)
        if evicted and page.back >= 0:
            self._left(code != page.back)
        if page.parent is not None:
            sibs = self._kids[page.parent]
            sibs.discard(key)
            if not sibs:
                del self._kids[page.parent]
        if evicted:
            for child in self._kids.get(key, ()):
                self._set_orphan(child, True)
        self._remember(key, count)

    # -- the interface (admission: kvaware_admission.py) ----------------------------------
    def _fanout_of(self, key: Key) -> int | None:
        """The fan-out of a page the policy holds; None if it holds no such page."""
        if self._bound:
            s = self._slot_of.get(key)
            return None if s is None or self._prev[s] == _UNLINKED else self._fanout[s]
        page = self._pages.get(key)
        return None if page is None else page.fanout

    def _add_fanout(self, key: Key) -> None:
        if self._bound:
            self._fanout[self._slot_of[key]] += 1
        else:
            self._pages[key].fanout += 1

    def _keys_only(self) -> None:
        if self._bound:
            raise RuntimeError("this kvaware policy is bound to a page table: use the slot methods")

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._keys_only()
        self._insert(key, hint)
        self._end_batch()  # a batch of admissions ends with an insert (as in slot mode)

    def _insert(self, key: Key, hint: PageHint) -> None:
        seen = self._gone.pop(key, 0)
        count = 0 if hint.last and not seen else min(seen + 1, MAX_COUNT)
        if count == 1 and key in self._small:
            count = 2
        parent = hint.parent
        page = _Page(0, 0, parent, self._pending.pop(key, 0))
        self._pages[key] = page
        code = self._count[key] = (self._floor << 4) + count
        if seen:
            page.back = code
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
        self._keys_only()
        gone, pages, count, buckets = self._gone, self._pages, self._count, self._buckets
        insert, pending, value = self._insert, self._pending, _VALUE
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
            pages[k] = _Page(
                p, code, None, pending.pop(k, 0) if pending else 0, code if seen else -1
            )
            buckets[p & _MASK][k] = None
        self._end_batch()
        if not self._fixed and len(pages) > self._capacity:
            self._capacity = len(pages)
            self._limit = self._history * self._capacity

    def touch(self, key: Key) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Iterable[Key]) -> None:
        self._keys_only()
        count = self._count
        now = self._floor << 4
        for k in keys:
            code = count.get(k)
            if code is None:
                raise unknown(k, self.name)
            c = code & 15
            count[k] = now + (c + 1 if c < MAX_COUNT else c)

    def remove(self, key: Key) -> None:
        self._keys_only()
        if key not in self._pages:
            raise unknown(key, self.name)
        self._detach(key, evicted=False)

    # -- undoing an eviction, and looking ahead -------------------------------------------
    def evicted_state(self, keys: Sequence[Key]) -> list[object]:
        self._keys_only()
        return [self._recent[k] for k in keys]

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        """Put back victims at the head of the queue each left, with their use codes; their
        history entries are taken back and the children their eviction stranded are requeued
        by their own use codes. ``L`` and the scan gate's average are not rewound."""
        self._keys_only()
        pages, count, gone, kids = self._pages, self._count, self._gone, self._kids
        for k, state in zip(reversed(keys), reversed(states)):
            assert isinstance(state, tuple)
            page: _Page = state[0]
            code: int = state[1]
            gone.pop(k, None)
            pages[k] = page
            count[k] = code
            parent = page.parent
            orphan = parent is not None and parent not in pages and parent in gone
            if orphan:
                page.prio = _ORPHAN
                queue = self._orphans
            else:
                if page.prio == _ORPHAN:  # it was stranded, and is no more
                    page.code = code
                    page.prio = (code >> 4) + _VALUE[code & 15]
                queue = self._buckets[page.prio & _MASK]
            queue[k] = None
            queue.move_to_end(k, last=False)
            if parent is not None:
                kids.setdefault(parent, set()).add(k)
            for child in kids.get(k, ()):
                self._set_orphan(child, False, reset=False)

    def _clone(self) -> KVAwarePolicy:
        """A copy that shares nothing mutable (``_slot_of``, read-only here, is shared)."""
        c = copy.copy(self)
        for name in ("_run", "_small", "_decisions", "_count", "_pending", "_recent"):
            setattr(c, name, copy.copy(getattr(self, name)))
        # the history never steers a victim (only inserts read it): the copy starts without it
        c._gone = OrderedDict()
        c._orphans = self._orphans.copy()
        c._pages = {k: replace(p) for k, p in self._pages.items()}
        c._buckets = [b.copy() for b in self._buckets]
        c._kids = {k: set(v) for k, v in self._kids.items()}
        for name in ("_prev", "_next", "_qlen", "_where", "_code", "_qcode", "_key"):
            setattr(c, name, list(getattr(self, name)))
        for name in ("_parent", "_fanout", "_back", "_bump", "_start", "_start_prio"):
            setattr(c, name, list(getattr(self, name)))
        return c

    def candidates(self, n: int, can_evict: CanEvict | None = None) -> list[Key]:
        """The next victims, as :meth:`evict_many` would choose them now (on a copy: O(pages))."""
        self._keys_only()
        return self._clone().evict_many(n, can_evict or (lambda k: True))

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """The next victim slots, as :meth:`evict_slots` would choose them now (on a copy:
        O(capacity))."""
        return self._clone().evict_slots(n, can_evict)

    def evict(self, can_evict: CanEvict) -> Key | None:
        out = self.evict_many(1, can_evict)
        return out[0] if out else None

    def _evict_orphans(self, n: int, can_evict: CanEvict, out: list[Key]) -> None:
        # Oldest first; evicting one may strand more (appended): they are seen in this call.
        orphans = self._orphans
        passed: list[Key] = []
        while len(out) < n and orphans:
            key = next(iter(orphans))
            if can_evict(key):
                self._detach(key, evicted=True)
                out.append(key)
            else:
                del orphans[key]
                passed.append(key)
        for key in passed:  # passed over: to the back
            orphans[key] = None

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        self._keys_only()
        self._recent = recent = {}
        out: list[Key] = []
        orphans = self._orphans
        if orphans:  # stranded blocks first, oldest first
            self._evict_orphans(n, can_evict, out)
        buckets, pages, count, kids = self._buckets, self._pages, self._count, self._kids
        gone, limit = self._gone, self._limit
        prio = self._floor
        top = prio + _MASK + 1  # one lap of the ring (see Laps, top of the module)
        skips: dict[int, int] = {}  # bucket -> unevictable pages still to pass over this call
        moved, lap = 0, -1  # pages moved to their new bucket; len(out) + moved at the last lap
        while len(out) < n:
            q = buckets[prio & _MASK]
            if not q or (skips and skips.get(prio, 1) <= 0):
                prio += 1
                if prio >= top:  # see Laps (top of the module)
                    if len(out) + moved == lap:
                        break
                    lap = len(out) + moved
                    top = prio + _MASK + 1
                continue
            key = q.popitem(last=False)[0]
            page = pages[key]
            code = count[key]
            if code != page.code:  # used since it was queued: to its bucket now
                page.code = code
                p = page.prio = (code >> 4) + _VALUE[code & 15]
                buckets[p & _MASK][key] = None
                moved += 1
            elif can_evict(key):
                self._floor = prio
                recent[key] = (page, code)
                del pages[key], count[key]
                if page.back >= 0:
                    self._left(code != page.back)
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
        return self._n if self._bound else len(self._pages)

    def __contains__(self, key: object) -> bool:
        if not self._bound:
            return key in self._pages
        s = self._slot_of.get(key)
        return s is not None and self._prev[s] != _UNLINKED

    # -- slots (bound to a page table) ---------------------------------------------------
    # The same rules over per-slot int lists; the queues are intrusive lists with one sentinel
    # per queue, as in ``lru.py``. ``_where[s]`` is the page's priority (its bucket) or _ORPHAN,
    # ``_qcode[s]`` its use code when queued (``_Page.code``). Ghost, chain and batch state
    # (``_gone``, ``_kids``, ``_pending``) stay keyed by page key, so both modes decide alike.
    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        if self._pages or self._gone or self._bound:
            raise RuntimeError("bind_slots needs a fresh kvaware policy")
        self._bound = True
        self._slot_of = slot_of
        self._head = capacity  # bucket b's sentinel is capacity + b; the orphans' is _ORPHANS
        self._orph = capacity + _ORPHANS
        size = capacity + _ORPHANS + 1
        self._prev = [_UNLINKED] * size
        self._next = [_UNLINKED] * size
        for h in range(capacity, size):
            self._prev[h] = self._next[h] = h
        self._qlen = [0] * (_ORPHANS + 1)
        self._where = [0] * capacity
        self._code = [0] * capacity
        self._qcode = [0] * capacity
        self._key = [None] * capacity
        self._parent = [None] * capacity
        self._fanout = [0] * capacity
        self._back = [-1] * capacity

    def _link(self, s: int, q: int) -> None:
        """Append slot ``s`` to queue ``q`` (a bucket, or _ORPHANS)."""
        h = self._head + q
        prv = self._prev
        t = prv[h]
        self._next[t] = s
        prv[s] = t
        self._next[s] = h
        prv[h] = s
        self._qlen[q] += 1

    def _unlink(self, s: int) -> None:
        prv, nxt = self._prev, self._next
        p = prv[s]
        n = nxt[s]
        nxt[p] = n
        prv[n] = p
        prv[s] = _UNLINKED
        w = self._where[s]
        self._qlen[_ORPHANS if w == _ORPHAN else w & _MASK] -= 1

    def _enqueue_slot(self, s: int, orphan: bool) -> None:
        code = self._qcode[s] = self._code[s]
        if orphan:
            self._where[s] = _ORPHAN
            self._link(s, _ORPHANS)
        else:
            self._where[s] = prio = (code >> 4) + _VALUE[code & 15]
            self._link(s, prio & _MASK)

    def _set_orphan_slot(self, s: int, orphan: bool, reset: bool = True) -> None:
        if (self._where[s] == _ORPHAN) != orphan:
            self._unlink(s)
            if not orphan and reset:  # restored: its priority counts from now
                self._code[s] = (self._floor << 4) + (self._code[s] & 15)
            self._enqueue_slot(s, orphan)

    def _detach_slot(self, s: int, key: Key, evicted: bool) -> None:
        code = self._code[s]
        count = code & 15
        self._unlink(s)
        if evicted and self._back[s] >= 0:
            self._left(code != self._back[s])
        self._n -= 1
        parent = self._parent[s]  # kept: restore_slots reads it (insert_slots overwrites it)
        if parent is not None:
            sibs = self._kids[parent]
            sibs.discard(key)
            if not sibs:
                del self._kids[parent]
        if evicted:
            slot_of = self._slot_of
            for child in self._kids.get(key, ()):
                self._set_orphan_slot(slot_of[child], True)
        self._remember(key, count)

    def insert_slots(
        self, slots: Sequence[int], keys: Sequence[Key], hints: Sequence[PageHint]
    ) -> None:
        gone, pending, kids, slot_of = self._gone, self._pending, self._kids, self._slot_of
        small, back = self._small, self._back
        prv, nxt, qlen, head = self._prev, self._next, self._qlen, self._head
        where, code, qcode, key_of = self._where, self._code, self._qcode, self._key
        parent_of, fanout = self._parent, self._fanout
        if self._tables_floor != self._floor:  # constant below: only evictions move it
            self._tables()
        start, start_prio = self._start, self._start_prio
        for s, k, h in zip(slots, keys, hints):
            seen = gone.pop(k, 0) if gone else 0
            c = 0 if h.last and not seen else (seen + 1 if seen < MAX_COUNT else MAX_COUNT)
            if c == 1 and small and k in small:
                c = 2
            code[s] = qcode[s] = start[c]
            back[s] = start[c] if seen else -1
            key_of[s] = k
            fanout[s] = pending.pop(k, 0) if pending else 0
            parent = parent_of[s] = h.parent
            if parent is not None:
                ps = slot_of.get(parent)
                if (ps is None or prv[ps] == _UNLINKED) and parent in gone:
                    where[s] = _ORPHAN
                    q = _ORPHANS
                else:
                    where[s] = p = start_prio[c]
                    q = p & _MASK
                sibs = kids.get(parent)
                if sibs is None:
                    kids[parent] = {k}
                else:
                    sibs.add(k)
            else:
                where[s] = p = start_prio[c]
                q = p & _MASK
            hq = head + q  # append to queue q
            t = prv[hq]
            nxt[t] = s
            prv[s] = t
            nxt[s] = hq
            prv[hq] = s
            qlen[q] += 1
            if kids:
                mine = kids.get(k)
                if mine:
                    for child in mine:
                        self._set_orphan_slot(slot_of[child], False)
        self._n += len(slots)
        self._end_batch()
        if not self._fixed and self._n > self._capacity:
            self._capacity = self._n
            self._limit = self._history * self._capacity

    def _tables(self) -> None:
        """The use codes and priorities of this floor, by count: a touch or an insert then
        stores a shared int instead of making one (most are too large for CPython's cache)."""
        now = self._floor << 4
        self._bump = [now + (c + 1 if c < MAX_COUNT else c) for c in range(16)]
        self._start = [now + c for c in range(16)]
        self._start_prio = [self._floor + v for v in _VALUE]
        self._tables_floor = self._floor

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        if self._tables_floor != self._floor:
            self._tables()
        code, bump = self._code, self._bump
        for s in slots:
            code[s] = bump[code[s] & 15]

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        for s, k in zip(slots, keys):
            self._detach_slot(s, k, evicted=False)

    def _evict_orphan_slots(self, n: int, can_evict: CanEvictSlot | None, out: list[int]) -> None:
        # As key mode's _evict_orphans: strays stranded on the way are seen in this call.
        qlen, nxt, oh = self._qlen, self._next, self._orph
        passed: list[int] = []
        while len(out) < n and qlen[_ORPHANS]:
            s = nxt[oh]
            if can_evict is None or can_evict(s):
                self._detach_slot(s, self._key[s], evicted=True)
                out.append(s)
            else:
                self._unlink(s)
                passed.append(s)
        for s in passed:  # passed over: to the back
            self._link(s, _ORPHANS)

    def _link_head(self, s: int, q: int) -> None:
        """Put slot ``s`` at the head of queue ``q``."""
        h = self._head + q
        prv, nxt = self._prev, self._next
        n = nxt[h]
        nxt[h] = s
        prv[s] = h
        nxt[s] = n
        prv[n] = s
        self._qlen[q] += 1

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        return [None] * len(slots)  # a victim's slot keeps its state until it is reused

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        """:meth:`restore` in slot mode (the same rules)."""
        gone, kids, slot_of, prv = self._gone, self._kids, self._slot_of, self._prev
        where, code, qcode = self._where, self._code, self._qcode
        for s, k in zip(reversed(slots), reversed(keys)):
            gone.pop(k, None)
            self._key[s] = k  # a MOVING page may have been renamed (rekey)
            parent = self._parent[s]
            orphan = False
            if parent is not None:
                ps = slot_of.get(parent)
                orphan = (ps is None or prv[ps] == _UNLINKED) and parent in gone
            if orphan:
                where[s] = _ORPHAN
                q = _ORPHANS
            else:
                if where[s] == _ORPHAN:  # it was stranded, and is no more
                    cd = qcode[s] = code[s]
                    where[s] = (cd >> 4) + _VALUE[cd & 15]
                q = where[s] & _MASK
            self._link_head(s, q)
            self._n += 1
            if parent is not None:
                kids.setdefault(parent, set()).add(k)
            for child in kids.get(k, ()):
                self._set_orphan_slot(slot_of[child], False, reset=False)

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        out: list[int] = []
        qlen = self._qlen
        if qlen[_ORPHANS]:  # stranded blocks first, oldest first
            self._evict_orphan_slots(n, can_evict, out)
        prv, nxt, head = self._prev, self._next, self._head
        where, code, qcode, key_of, parent_of = (
            self._where,
            self._code,
            self._qcode,
            self._key,
            self._parent,
        )
        kids, gone, limit, slot_of, value, back = (
            self._kids,
            self._gone,
            self._limit,
            self._slot_of,
            _VALUE,
            self._back,
        )
        prio = self._floor
        top = prio + _MASK + 1  # one lap of the ring (see Laps, top of the module)
        skips: dict[int, int] = {}  # bucket -> unevictable pages still to pass over this call
        moved, lap = 0, -1  # pages moved to their new bucket; len(out) + moved at the last lap
        while len(out) < n:
            b = prio & _MASK
            if not qlen[b] or (skips and skips.get(prio, 1) <= 0):
                prio += 1
                if prio >= top:  # see Laps (top of the module)
                    if len(out) + moved == lap:
                        break
                    lap = len(out) + moved
                    top = prio + _MASK + 1
                continue
            h = head + b
            s = nxt[h]  # the head of the bucket
            cd = code[s]
            if cd != qcode[s]:  # used since it was queued: to its bucket now
                qcode[s] = cd
                where[s] = p = (cd >> 4) + value[cd & 15]
                moved += 1
                q = p & _MASK
                nh = nxt[s]
                nxt[h] = nh
                prv[nh] = h
                qlen[b] -= 1
                hq = head + q
                t = prv[hq]
                nxt[t] = s
                prv[s] = t
                nxt[s] = hq
                prv[hq] = s
                qlen[q] += 1
            elif can_evict is None or can_evict(s):
                self._floor = prio
                if back[s] >= 0:
                    self._left(cd != back[s])
                nh = nxt[s]
                nxt[h] = nh
                prv[nh] = h
                prv[s] = _UNLINKED
                qlen[b] -= 1
                self._n -= 1
                key = key_of[s]
                parent = parent_of[s]  # kept for restore_slots
                if parent is not None:
                    sibs = kids[parent]
                    sibs.discard(key)
                    if not sibs:
                        del kids[parent]
                if kids:
                    mine = kids.get(key)
                    if mine:
                        for child in mine:
                            self._set_orphan_slot(slot_of[child], True)
                gone[key] = cd & 15
                if len(gone) > limit:
                    gone.popitem(last=False)
                out.append(s)
                if qlen[_ORPHANS]:  # the victim's children, now stranded, go next
                    self._evict_orphan_slots(n, can_evict, out)
            else:
                if nxt[s] != h:  # to the back of its queue
                    nh = nxt[s]
                    nxt[h] = nh
                    prv[nh] = h
                    t = prv[h]
                    nxt[t] = s
                    prv[s] = t
                    nxt[s] = h
                    prv[h] = s
                skips[prio] = skips.get(prio, qlen[b]) - 1
        return out
