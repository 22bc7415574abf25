"""kvaware on keys: the policy as it ran before it kept only the slot mode, kept as the
reference its slot implementation must match decision for decision (the differential test in
``test_policies.py`` binds it through ``policy_refs.KeyPolicy``). Its admission rules are the
policy's own (``ConversationAdmission``); what it checks is the queueing, the chains, the orphan
cascade and the rollback, written here over ordered dicts of keys.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from tierkv.policies.base import NO_HINT, Key, PageHint
from tierkv.policies.history import History
from tierkv.policies.kvaware import MAX_COUNT
from tierkv.policies.kvaware_admission import ConversationAdmission, admit_chain

CanEvict = Callable[[Key], bool]
_VALUE = (0, 2, 5, *(2 * (c + 1) for c in range(3, MAX_COUNT + 1)))  # half units, by use count
_ORPHAN = -1  # _Page.prio in the orphan queue
_MASK = 63  # a ring of 64 priority buckets


def unknown(key: Key, policy: str) -> KeyError:
    return KeyError(f"policy {policy!r} holds no page {key!r}")


@dataclass(slots=True)
class _Page:
    prio: int  # GreedyDual priority when queued (its bucket); _ORPHAN in the orphan queue
    code: int  # its use code when queued
    parent: Key | None
    fanout: int = 0  # never-seen children that tried to extend this page
    back: int = -1  # its use code when it came back from the history; -1: it did not


class RefKVAware(ConversationAdmission):
    """kvaware's rules over keys (see ``tierkv.policies.kvaware.KVAwarePolicy``)."""

    name = "kvaware-keys"

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
        self._slot_of = self._pages  # the resident keys (admit_many's batch loop reads them)
        # queued pages by priority, a ring: every queued priority lies in [L, L + 32] (half units)
        self._buckets: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(_MASK + 1)]
        self._orphans: OrderedDict[Key, None] = OrderedDict()
        self._kids: dict[Key, set[Key]] = {}  # parent key -> resident children
        self._gone = History()  # departed/declined key -> count (the policy's own history)
        self._pending: dict[Key, int] = {}  # admitted, not yet inserted -> fanout so far
        self._floor = 0  # GreedyDual's L: the priority of the last victim
        self._recent: dict[Key, tuple[_Page, int]] = {}  # key mode: last call's victims
        self._chain_loop = admit_chain  # (the Python one: the policy's may be C)

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
        page = self._pages.get(key)
        return None if page is None else page.fanout

    def _add_fanout(self, key: Key) -> None:
        self._pages[key].fanout += 1

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
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
        count = self._count
        now = self._floor << 4
        for k in keys:
            code = count.get(k)
            if code is None:
                raise unknown(k, self.name)
            c = code & 15
            count[k] = now + (c + 1 if c < MAX_COUNT else c)

    def remove(self, key: Key) -> None:
        if key not in self._pages:
            raise unknown(key, self.name)
        self._detach(key, evicted=False)

    # -- undoing an eviction, and looking ahead -------------------------------------------
    def evicted_state(self, keys: Sequence[Key]) -> list[object]:
        return [self._recent[k] for k in keys]

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        """Put back victims at the head of the queue each left, with their use codes; their
        history entries are taken back and the children their eviction stranded are requeued
        by their own use codes. ``L`` and the scan gate's average are not rewound."""
        pages, count, gone, kids = self._pages, self._count, self._gone, self._kids
        for k, state in zip(reversed(keys), reversed(states)):
            assert isinstance(state, tuple)
            page: _Page = state[0]
            code: int = state[1]
            gone.pop(k)
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

    def _clone(self) -> RefKVAware:
        c = copy.copy(self)
        for name in ("_run", "_small", "_decisions", "_count", "_pending", "_recent"):
            setattr(c, name, copy.copy(getattr(self, name)))
        c._gone = History()
        c._orphans = self._orphans.copy()
        c._pages = {k: replace(p) for k, p in self._pages.items()}
        c._buckets = [b.copy() for b in self._buckets]
        c._kids = {k: set(v) for k, v in self._kids.items()}
        return c

    def candidates(self, n: int, can_evict: CanEvict | None = None) -> list[Key]:
        """The next victims, as :meth:`evict_many` would choose them now (on a copy: O(pages))."""
        return self._clone().evict_many(n, can_evict or (lambda k: True))

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
                gone.put(key, code & 15)
                gone.trim(limit)
                out.append(key)
                if orphans:  # the victim's children, now stranded, go next
                    self._evict_orphans(n, can_evict, out)
            else:
                q[key] = None  # to the back of its queue
                skips[prio] = skips.get(prio, len(q)) - 1
        return out

    def miss(self, keys: Iterable[Key]) -> None:
        return None  # kvaware takes no feedback from misses

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages
