"""KV-aware eviction: chain-aware GreedyDual on use counts, with conversation-shaped admission.

Its admission rules live in ``kvaware_admission.py``; its two inner loops (insertion, and the
eviction scan with its orphan cascade) in ``kvaware_loops.py``, in Python and in C.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Mapping, MutableSequence, Sequence
from itertools import compress

from tierkv.policies.base import (
    CanEvictSlot,
    ChainHint,
    ChainPart,
    EvictionPolicy,
    Hints,
    Key,
)
from tierkv.policies.history import History
from tierkv.policies.kids import add_child, children, drop_child
from tierkv.policies.kvaware_admission import (
    HEAD_PER_PAGES,
    SCAN_WARMUP,
    STEP_BLOCKS,
    STEP_PER_PAGES,
    ConversationAdmission,
)
from tierkv.policies.kvaware_loops import (
    LOOPS,
    MASK,
    MAX_COUNT,
    ORPHAN,
    ORPHANS,
    VALUE,
    Loops,
    State,
)
from tierkv.policies.links import Links

__all__ = [
    "HEAD_PER_PAGES",
    "MAX_COUNT",
    "SCAN_WARMUP",
    "STEP_BLOCKS",
    "STEP_PER_PAGES",
    "KVAwarePolicy",
]

# The constants live with the loops (kvaware_loops.py): MAX_COUNT, VALUE (GreedyDual value by
# use count, in half units: 0 for a never-seen last block, then 1, 2.5, 4, 5, ... (``count + 1``
# from three uses on). Pages used once or twice are worth less than ``count + 1``: measured on
# the conversation trace, a once-used page reuses within 1,000 requests about as often as a
# twice-used one with one unit less to live (0.18 vs 0.20)), the 64 buckets (MASK) and the
# orphan queue (ORPHANS).
# Laps: a page passed over while unevictable ends up below the floor once a page above it is
# evicted (so does a victim put back by restore), in any bucket of the ring. A scan therefore goes
# round the whole ring of 64 buckets, lap after lap while a lap still evicts or moves a page, and
# stops early only when it has its n victims.
_NONE = object()  # no entry in _kids


def _ints(fill: int, n: int, flat: bool) -> MutableSequence[int]:
    """A per-slot int table: ``n`` copies of ``fill``, in an ``array('q')`` when ``flat`` (for
    the C loops; the Python ones run faster on a list)."""
    return array("q", (fill,)) * n if flat else [fill] * n


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
    (O(1) amortized, plus one step per pinned page passed over). Per-page state lives in
    per-slot lists and the queues are ``links.py`` queues over the slots; ghost, chain and batch
    state (the history, the children of each parent, the batch being admitted) stay keyed by
    page key, since they outlive a slot. With no hint at all (``NO_HINT``, as ``KVStore``
    passes) the policy admits every page and runs as chain-blind GreedyDual; a hint without
    ``parent`` still goes through the head rule and the scan gate.

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
        loops: the inner loops to run, ``kvaware_loops.NATIVE`` (C) or ``PYTHON`` (the same
            decisions); ``None``: the C ones where the extension was built.
    """

    name = "kvaware"
    admits = True

    def __init__(
        self,
        capacity: int | None = None,
        history: float = 4.0,
        max_fanout: int = 1,
        short_request: int = 12,
        head_blocks: int | None = None,
        step_blocks: int | None = None,
        loops: Loops | None = None,
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
        # parent key -> its resident child, or a set of them (most pages have one child: no
        # set to make and drop per page); a set stays a set until it is empty
        self._kids: dict[Key, Key | set[Key]] = {}
        self._gone = History()  # departed/declined key -> count, oldest first
        self._pending: dict[Key, int] = {}  # admitted, not yet inserted -> fanout so far
        self._floor = 0  # GreedyDual's L: the priority of the last victim
        self._n = 0
        self._chosen: Sequence[int] = ()  # the last evict_chosen's victims (restore_slots)
        self._loops = loops or LOOPS
        self._chain_loop = self._loops.admit
        # per slot (see bind_slots): the queues (64 priority buckets, a ring, and the orphans);
        # with the C loops their ints are in array('q')s, as the links (the collector does not
        # walk them entry by entry, and the C reads them as memory), else in lists
        flat = self._flat = self._loops.native
        self._links = Links(0, ORPHANS + 1, flat)
        self._where = _ints(0, 0, flat)  # its priority (its bucket is prio & MASK), or ORPHAN
        self._code = _ints(0, 0, flat)  # its use code: (L at its last use) * 16 + uses
        self._qcode = _ints(0, 0, flat)  # its use code when queued
        # slot -> key and slot -> parent key: dicts of atomic objects, which the collector
        # neither tracks nor walks (lists of a page key per slot cost a full pass ~8 ms at
        # 10,000 idle sequences)
        self._key: dict[int, Key] = {}
        self._parent: dict[int, Key | None] = {}
        self._fanout = _ints(0, 0, flat)  # never-seen children that tried to extend it
        self._back = _ints(0, 0, flat)  # its use code when it came back from the history; -1: not
        self._state: State = self._state_tuple()

    def _state_tuple(self) -> State:
        """What the loops read and write, in one tuple (see kvaware_loops.State)."""
        return (
            self._links,
            self._gone,
            self._kids,
            self._slot_of,
            self._where,
            self._code,
            self._qcode,
            self._key,
            self._parent,
            self._back,
            self._fanout,
            self._pending,
            self._small,
        )

    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        self._bind(capacity, slot_of)
        flat = self._flat
        self._links = Links(capacity, ORPHANS + 1, flat)
        self._where = _ints(0, capacity, flat)
        self._code = _ints(0, capacity, flat)
        self._qcode = _ints(0, capacity, flat)
        self._key = {}
        self._parent = {}
        self._fanout = _ints(0, capacity, flat)
        self._back = _ints(-1, capacity, flat)
        self._state = self._state_tuple()

    def __len__(self) -> int:
        return self._n

    def holds(self, s: int) -> bool:
        return self._links.linked(s)

    @staticmethod
    def _value(count: int) -> float:
        return VALUE[count] / 2

    # -- what admission reads (kvaware_admission.py) --------------------------------------
    def _fanout_of(self, key: Key) -> int | None:
        """The fan-out of a page the policy holds; None if it holds no such page."""
        s = self._slot_of.get(key)
        return None if s is None or not self._links.linked(s) else self._fanout[s]

    def _add_fanout(self, key: Key) -> None:
        self._fanout[self._slot_of[key]] += 1

    # -- bookkeeping ---------------------------------------------------------------------
    def _requeue(self, s: int, orphan: bool, reset: bool = True) -> None:
        """Move linked slot ``s`` into the orphan queue, or out of it to its bucket (its
        priority counting from now unless not ``reset``)."""
        if (self._where[s] == ORPHAN) == orphan:
            return
        links = self._links
        links.unlink(s)
        if orphan:
            self._qcode[s] = self._code[s]
            self._where[s] = ORPHAN
            links.append(ORPHANS, s)
            return
        if reset:
            self._code[s] = (self._floor << 4) + (self._code[s] & 15)
        code = self._qcode[s] = self._code[s]
        self._where[s] = prio = (code >> 4) + VALUE[code & 15]
        links.append(prio & MASK, s)

    # -- the interface -------------------------------------------------------------------
    def insert_slots(self, slots: Sequence[int], keys: Sequence[Key], hints: Hints) -> None:
        n = len(keys)
        lasts = [False] * n
        if hints is None:
            parents: Sequence[Key | None] = [None] * n
            check = False  # whether a page's parent may have left (an orphan on arrival)
        elif isinstance(hints, ChainHint):
            parents = [hints.parent, *keys[:-1]]
            if n and hints.depth + n == hints.blocks:
                lasts[-1] = True
            check = True  # (block i > 0 extends the block just queued: see the loop)
        elif isinstance(hints, ChainPart):  # the pages admission kept of a chain's run
            whole, kept = hints.keys, hints.kept
            parents = list(compress([hints.chain.parent, *whole[:-1]], kept))
            if n and kept[-1] and hints.chain.depth + len(whole) == hints.chain.blocks:
                lasts[-1] = True
            check = True
        else:
            parents = [h.parent for h in hints]
            lasts = [h.last for h in hints]
            check = True
        self._loops.insert(
            self._state,
            slots,
            keys,
            parents,
            lasts,
            check,
            self._floor,
        )
        self._n += n
        self._end_batch()
        if not self._fixed and self._n > self._capacity:
            self._capacity = self._n
            self._limit = self._history * self._capacity

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._loops.touch(self._code, slots, self._floor)

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        links, kids = self._links, self._kids
        for s, k in zip(slots, keys):
            links.unlink(s)
            self._n -= 1
            parent = self._parent.get(s)
            if parent is not None:
                drop_child(kids, parent, k)
            self._remember(k, self._code[s] & 15)

    # -- eviction ------------------------------------------------------------------------
    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """Victims in order: stranded blocks (the orphan queue, oldest first, then the
        children each eviction strands, which are seen in this call) before the lowest
        bucket's head (the loop: ``kvaware_loops.evict``)."""
        if self._chosen:
            self._chosen = ()
        out, self._floor, self._back_left, self._back_used, self._back_seen = self._loops.evict(
            self._state,
            n,
            can_evict,
            self._limit,
            self._floor,
            self._back_left,
            self._back_used,
            self._back_seen,
        )
        self._n -= len(out)
        return out

    def evict_chosen(self, slots: Sequence[int]) -> list[int]:
        """The victims a caller chose, taken as :meth:`evict_slots` takes one (the loop:
        ``kvaware_loops.evict_given``) without scanning the buckets for them: a batch-32 step
        (2,800 victims an eviction call, 28,000 pages queued) spent ~4 ms a call on that scan.
        The floor (``L``) stays."""
        out = self._chosen = list(slots)
        self._back_left, self._back_used, self._back_seen = self._loops.evict_given(
            self._state, out, self._limit, self._back_left, self._back_used, self._back_seen
        )
        self._n -= len(out)
        return out

    # -- undoing an eviction, and looking ahead -------------------------------------------
    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        """Per victim the slot it was ahead of in its queue when it left, for one that
        :meth:`evict_chosen` took (an unlinked slot's ``next`` still names it); -1 for one
        taken from a bucket's head (restored there). Read only on this path: the chosen
        victims' hot path (a step's room) stores one reference."""
        if not self._chosen:
            return [-1] * len(slots)
        chosen, nxt = set(self._chosen), self._links.next
        return [nxt[s] if s in chosen else -1 for s in slots]

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        """Put back victims where each left its queue (the head of its bucket, or, for one a
        caller chose, ahead of the page it was ahead of), with their use codes; their history
        entries are taken back and the children their eviction stranded are requeued by their
        own use codes. ``L`` and the scan gate's average are not rewound."""
        gone, kids, slot_of, links = self._gone, self._kids, self._slot_of, self._links
        where, code, qcode = self._where, self._code, self._qcode
        for s, k, ahead in zip(reversed(slots), reversed(keys), reversed(states)):
            gone.pop(k)
            self._key[s] = k  # a MOVING page may have been renamed (rekey)
            parent = self._parent.get(s)
            orphan = False
            if parent is not None:
                ps = slot_of.get(parent)
                orphan = (ps is None or not links.linked(ps)) and parent in gone
            if orphan:
                where[s] = ORPHAN
                q = ORPHANS
            else:
                if where[s] == ORPHAN:  # it was stranded, and is no more
                    cd = qcode[s] = code[s]
                    where[s] = (cd >> 4) + VALUE[cd & 15]
                q = where[s] & MASK
            if isinstance(ahead, int) and ahead >= 0:
                links.put_before(q, s, ahead)
            else:
                links.appendleft(q, s)
            self._n += 1
            if parent is not None:
                add_child(kids, parent, k)
            mine = kids.get(k, _NONE)
            if mine is not _NONE:
                for child in children(mine):
                    self._requeue(slot_of[child], False, reset=False)

    def _clone(self) -> KVAwarePolicy:
        """A copy that shares nothing mutable (``_slot_of``, read-only here, is shared)."""
        c = copy.copy(self)
        for name in ("_run", "_small", "_decisions", "_pending"):
            setattr(c, name, copy.copy(getattr(self, name)))
        # the history never steers a victim (only inserts read it): the copy starts without it
        c._gone = History()
        c._kids = {k: set(v) if isinstance(v, set) else v for k, v in self._kids.items()}
        c._links = self._links.copy()
        for name in ("_where", "_code", "_qcode", "_key", "_parent", "_fanout", "_back"):
            setattr(c, name, copy.copy(getattr(self, name)))
        c._state = c._state_tuple()
        return c

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """The next victim slots, as :meth:`evict_slots` would choose them now (on a copy:
        O(capacity))."""
        return self._clone().evict_slots(n, can_evict)
