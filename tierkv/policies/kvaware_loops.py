"""kvaware's two inner loops, insertion and eviction, in Python: the reference of their C twin.

``policies/_kvaware.c`` (built by setup.py where a compiler is; ``TIERKV_NO_EXTENSIONS=1``
skips it) runs the same loops over the same lists and dicts, step for step; kvaware uses it when
it is there (:data:`LOOPS`). ``test_policies.py`` runs both on the same random op streams and
requires the same victims, queues and history. A loop reads and writes the policy's state
through one tuple (:data:`State`, built by ``KVAwarePolicy.bind_slots``)::

    (links, history, kids, slot_of, where, code, qcode, key_of, parent_of, back, fanout,
     pending, small)

See ``kvaware.py`` for what each holds.

The file stays whole (over 400 lines): it is the reference of one C file, loop for loop
(insert, evict, evict_given, touch), and the test of the two reads them side by side.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from types import ModuleType
from typing import Any, cast

from tierkv.policies.base import CanEvictSlot, Key
from tierkv.policies.history import History
from tierkv.policies.kids import add_child, children, drop_child
from tierkv.policies.kvaware_admission import SCAN_DECAY, ChainLoop, admit_chain
from tierkv.policies.links import UNLINKED, Links

MAX_COUNT = 15
"""Use counts saturate here; the count is also the page's value class."""

VALUE = (0, 2, 5, *(2 * (c + 1) for c in range(3, MAX_COUNT + 1)))
"""GreedyDual value by use count, in half units (see ``kvaware.py``)."""

MASK = 63  # priority buckets: a power of two above max(VALUE) + 1
ORPHANS = MASK + 1  # the orphan queue's index after the buckets'
ORPHAN = -1  # ``where[s]`` of a page in the orphan queue
_NONE = object()  # no entry in kids

State = tuple[
    Links,  # flat: array('q')s
    History,
    dict[Key, Any],  # kids: parent -> its resident child, or a set of them
    Mapping[Key, int],  # slot_of
    MutableSequence[int],  # where (array('q'), as code, qcode, back and fanout)
    MutableSequence[int],  # code
    MutableSequence[int],  # qcode
    dict[int, Key],  # key_of: slot -> key
    dict[int, Key | None],  # parent_of: slot -> parent (missing: None)
    MutableSequence[int],  # back
    MutableSequence[int],  # fanout
    dict[Key, int],  # pending
    set[Key],  # small
]
Evict = Callable[
    [State, int, CanEvictSlot | None, float, int, float, float, int],
    tuple[list[int], int, float, float, int],
]
EvictGiven = Callable[[State, Sequence[int], float, float, float, int], tuple[float, float, int]]
Insert = Callable[
    [State, Sequence[int], Sequence[Key], Sequence[Key | None], Sequence[bool], bool, int], None
]
Touch = Callable[[MutableSequence[int], Sequence[int], int], None]


def touch(code: MutableSequence[int], slots: Sequence[int], floor: int) -> None:
    """Uses of resident pages (``KVAwarePolicy.touch_slots``): each one's use code becomes
    ``floor``'s, its count one up (saturating at :data:`MAX_COUNT`)."""
    now = floor << 4
    for s in slots:
        c = code[s] & 15
        code[s] = now + (c + 1 if c < MAX_COUNT else c)


def insert(
    st: State,
    slots: Sequence[int],
    keys: Sequence[Key],
    parents: Sequence[Key | None],
    lasts: Sequence[bool],
    check: bool,
    floor: int,
) -> None:
    """Queue new pages (``KVAwarePolicy.insert_slots`` after it has read the hints).

    ``check``: whether a page's parent may have left (an orphan on arrival); a new page's
    use code and priority count from ``floor``."""
    links, gone, kids, slot_of, where, code, qcode, key_of, parent_of, back, fanout = st[:11]
    pending, small = st[11], st[12]
    prv = links.prev
    extend = links.extend
    now = floor << 4
    run: list[int] = []  # slots for queue run_q, appended in one call
    run_q = -1
    # the history's pop (History.pop) written in line: one per page
    settled, remembered, forget, stamps = pending.pop, gone.value, gone.value.pop, gone.order
    # ``prev``: the page inserted just before; ``free``: it has no child yet (no entry in
    # kids), so a page extending it is in no danger of being an orphan and is its only
    # child: most pages of a chain's run (the parent just queued was popped from the
    # history, so the orphan test below could only say no)
    prev: object = _NONE
    free = False
    for s, k, parent, last in zip(slots, keys, parents, lasts):
        v = forget(k, None)
        if v is None:
            seen = 0
        else:
            del stamps[v >> 4]
            seen = v & 15
        c = 0 if last and not seen else min(seen + 1, MAX_COUNT)
        if c == 1 and small and k in small:
            c = 2
        code[s] = qcode[s] = cd = now + c
        back[s] = cd if seen else -1
        key_of[s] = k
        fanout[s] = settled(k, 0)
        parent_of[s] = parent
        if parent is None:
            where[s] = p = floor + VALUE[c]
            q = p & MASK
        elif parent is prev and free:
            kids[parent] = k
            where[s] = p = floor + VALUE[c]
            q = p & MASK
        else:
            if check and parent is not prev and parent in remembered:
                ps = slot_of.get(parent)
                orphan = ps is None or prv[ps] == UNLINKED
            else:
                orphan = False
            if orphan:
                where[s] = ORPHAN
                q = ORPHANS
            else:
                where[s] = p = floor + VALUE[c]
                q = p & MASK
            add_child(kids, parent, k)
        if q == run_q:
            run.append(s)
        else:
            if run:
                extend(run_q, run)
            run, run_q = [s], q
        mine = kids.get(k, _NONE)
        free = mine is _NONE
        if not free:  # its stranded children are orphans no more: to their buckets
            extend(run_q, run)
            run, run_q = [], -1
            for child in children(mine):
                c = slot_of[child]
                if where[c] == ORPHAN:
                    links.unlink(c)
                    cd = qcode[c] = code[c] = (floor << 4) + (code[c] & 15)
                    where[c] = p = (cd >> 4) + VALUE[cd & 15]
                    links.append(p & MASK, c)
        prev = k
    if run:
        extend(run_q, run)


def evict(
    st: State,
    n: int,
    can_evict: CanEvictSlot | None,
    limit: float,
    floor: int,
    left: float,
    used: float,
    seen: int,
) -> tuple[list[int], int, float, float, int]:
    """Up to ``n`` victims (``KVAwarePolicy.evict_slots``); returns them with the new floor
    and the scan gate's measure (``left``, ``used``, ``seen``: see ``kvaware_admission.py``).

    Victims in order: stranded blocks (the orphan queue, oldest first, then the children each
    eviction strands, which are seen in this call) before the lowest bucket's head. Orphans
    passed over go to the back of the orphan queue, after the stranded ones left. One loop
    with every queue splice written out: the orphan cascade is most of the evictions on
    conversation traffic (a chain is trimmed from its tail)."""
    links, gone, kids, slot_of, where, code, qcode, key_of, parent_of, back = st[:10]
    out: list[int] = []
    push = out.append
    size, nxt, prv, queue, base = links.size, links.next, links.prev, links.queue, links.base
    value = VALUE
    # the history's dicts, written in line (History.put): one stamp per victim
    hist, stamps, hget, stamp = gone.value, gone.order, gone.value.get, gone.stamp
    prio = floor
    top = prio + MASK + 1  # one lap of the ring (see Laps, kvaware.py)
    skips: dict[int, int] = {}  # bucket -> unevictable pages still to pass over this call
    moved, lap = 0, -1  # pages moved to their new bucket; len(out) + moved at the last lap
    fresh: list[int] = []  # stranded by the last victim, not yet queued
    none, orphan, decay = _NONE, ORPHAN, SCAN_DECAY
    orphans = size[ORPHANS] > 0  # orphans to look at before the next bucket victim
    try:
        while len(out) < n:
            if orphans:  # the orphan queue, then the fresh ones; evicting one strands its kids
                orphans = False
                if size[ORPHANS]:
                    fresh[:0] = links.take(ORPHANS, size[ORPHANS], None)
                passed: list[int] = []
                before = len(out)
                need = n - before  # >= 1 here
                grow = fresh.append
                for s in fresh:  # grows as children are stranded
                    if can_evict is not None and not can_evict(s):
                        passed.append(s)
                        continue
                    key = key_of[s]
                    cd = code[s]
                    if back[s] >= 0:
                        left = left * decay + 1.0
                        used = used * decay + (cd != back[s])
                        seen += 1
                    parent = parent_of.get(s)  # kept: restore_slots reads it
                    if parent is not None:
                        drop_child(kids, parent, key)
                    mine = kids.get(key, none)
                    if mine is none:
                        pass
                    else:  # its children, stranded in turn
                        for child in children(mine):
                            c = slot_of[child]
                            if where[c] != orphan:  # out of its bucket (Links.unlink)
                                a, z = prv[c], nxt[c]
                                nxt[a] = z
                                prv[z] = a
                                prv[c] = UNLINKED
                                size[queue[c]] -= 1
                                where[c] = orphan  # (an orphan's qcode is never read)
                                grow(c)
                    old = hget(key)  # remembered (as History.put), trimmed at the end
                    if old is not None:
                        del stamps[old >> 4]
                    hist[key] = (stamp << 4) | (cd & 15)
                    stamps[stamp] = key
                    stamp += 1
                    push(s)
                    need -= 1
                    if not need:
                        break
                i = len(out) - before + len(passed)  # the fresh ones looked at
                if i < len(fresh):
                    links.extend(ORPHANS, fresh[i:])
                if passed:
                    links.extend(ORPHANS, passed)
                fresh = []
                continue
            b = prio & MASK
            if not size[b] or (skips and skips.get(prio, 1) <= 0):
                prio += 1
                if prio >= top:  # see Laps (kvaware.py)
                    if len(out) + moved == lap:
                        break
                    lap = len(out) + moved
                    top = prio + MASK + 1
                continue
            hb = base + b
            s = nxt[hb]  # the head of the bucket
            cd = code[s]
            if cd != qcode[s]:  # used since it was queued: to its bucket now (Links.move)
                qcode[s] = cd
                where[s] = p = (cd >> 4) + value[cd & 15]
                moved += 1
                q = p & MASK
                z = nxt[s]
                nxt[hb] = z
                prv[z] = hb
                h = base + q
                a = prv[h]
                nxt[a] = s
                prv[s] = a
                nxt[s] = h
                prv[h] = s
                size[b] -= 1
                size[q] += 1
                queue[s] = q
            elif can_evict is None or can_evict(s):
                floor = prio
                if back[s] >= 0:
                    left = left * decay + 1.0
                    used = used * decay + (cd != back[s])
                    seen += 1
                z = nxt[s]  # out of its bucket (Links.unlink)
                nxt[hb] = z
                prv[z] = hb
                prv[s] = UNLINKED
                size[b] -= 1
                key = key_of[s]
                parent = parent_of.get(s)  # kept for restore_slots
                if parent is not None:
                    drop_child(kids, parent, key)
                if kids:
                    mine = kids.get(key, none)
                    if mine is not none:  # stranded: orphans now
                        for child in children(mine):
                            c = slot_of[child]
                            if where[c] != orphan:
                                a, z = prv[c], nxt[c]
                                nxt[a] = z
                                prv[z] = a
                                prv[c] = UNLINKED
                                size[queue[c]] -= 1
                                where[c] = orphan
                                fresh.append(c)
                old = hget(key)
                if old is not None:
                    del stamps[old >> 4]
                hist[key] = (stamp << 4) | (cd & 15)
                stamps[stamp] = key
                stamp += 1
                push(s)
                orphans = bool(fresh) or size[ORPHANS] > 0  # the victim's kids go next
            else:
                links.move(b, s)  # to the back of its queue
                skips[prio] = skips.get(prio, size[b]) - 1
        if fresh:  # stranded by the last victim, with no room left to evict them: queued
            links.extend(ORPHANS, fresh)
    finally:
        gone.stamp = stamp
        # The history trimmed once for the call: every victim went to its newest end (none
        # was in it: a resident page is not), and nothing here reads it, so the same oldest
        # keys leave as trimming after each victim would have removed.
        if len(hist) > limit:
            gone.trim(limit)
    return out, floor, left, used, seen


def evict_given(
    st: State, slots: Sequence[int], limit: float, left: float, used: float, seen: int
) -> tuple[float, float, int]:
    """Evict ``slots`` (``KVAwarePolicy.evict_chosen``: held, chosen by the caller), in order,
    each as :func:`evict` takes a victim: out of its queue, out of its parent's children, its
    own children stranded (to the orphan queue), remembered; the scan gate's measure updated
    (returned). No scan, and the floor stays (no bucket was walked). A slot stranded by an
    earlier one of ``slots`` leaves the stranded ones."""
    links, gone, kids, slot_of, where, code, _, key_of, parent_of, back = st[:10]
    prv = links.prev
    fresh: dict[int, None] = {}  # stranded, not yet queued (in order)
    none, orphan, decay = _NONE, ORPHAN, SCAN_DECAY
    try:
        for s in slots:
            cd = code[s]
            if back[s] >= 0:
                left = left * decay + 1.0
                used = used * decay + (cd != back[s])
                seen += 1
            if prv[s] == UNLINKED:  # stranded by an earlier victim of this call
                del fresh[s]
            else:
                links.unlink(s)
            key = key_of[s]
            parent = parent_of.get(s)  # kept: restore_slots reads it
            if parent is not None:
                drop_child(kids, parent, key)
            mine = kids.get(key, none) if kids else none
            if mine is not none:  # its children, stranded
                for child in children(mine):
                    c = slot_of[child]
                    if where[c] != orphan:
                        links.unlink(c)
                        where[c] = orphan
                        fresh[c] = None
            gone.put(key, cd & 15)  # remembered, trimmed at the end
        if fresh:
            links.extend(ORPHANS, fresh)
    finally:
        if len(gone.value) > limit:
            gone.trim(limit)
    return left, used, seen


class Loops:
    """The loops kvaware runs: the C twins where the extension was built, else these (and
    ``kvaware_admission.admit_chain``, the admission of a ChainHint's run)."""

    __slots__ = ("admit", "evict", "evict_given", "insert", "native", "touch")

    def __init__(
        self,
        evict: Evict,
        insert: Insert,
        admit: ChainLoop,
        touch: Touch,
        native: bool,
        given: EvictGiven,
    ) -> None:
        self.evict, self.insert, self.admit, self.touch = evict, insert, admit, touch
        self.evict_given = given
        self.native = native


PYTHON = Loops(evict, insert, admit_chain, touch, False, evict_given)
"""The pure-Python loops (the reference)."""


ABI = 3
"""The interface of the C loops this module calls (``_kvaware.c``'s ``ABI``): an extension
built from another source is not used."""


def _native() -> Loops | None:
    if os.environ.get("TIERKV_NATIVE_POLICY", "1") == "0":
        return None
    try:  # through sys.modules, so that a test can hide the module
        module: ModuleType = importlib.import_module(f"{__package__}._kvaware")
    except ImportError:  # not built: no compiler at install time, or TIERKV_NO_EXTENSIONS=1
        return None
    if getattr(module, "DECAY", None) != SCAN_DECAY or getattr(module, "ABI", None) != ABI:
        return None  # built from an older source: stale (rebuild: pip install -e .)
    return Loops(
        cast(Evict, module.evict),
        cast(Insert, module.insert),
        cast(ChainLoop, module.admit_chain),
        cast(Touch, module.touch),
        True,
        cast(EvictGiven, module.evict_given),
    )


NATIVE = _native()
"""The C loops (``policies/_kvaware.c``), or None where the extension was not built or
``TIERKV_NATIVE_POLICY=0`` turns it off."""

LOOPS = NATIVE or PYTHON
"""The loops a new :class:`~tierkv.policies.kvaware.KVAwarePolicy` runs."""
