"""kvaware's admission: which never-seen or returning pages a full tier stores at all.

The rules come from how conversation traffic reuses prefix blocks (``docs/policies.md``):
a first turn is declined but for its head, a later turn's small step is stored and a large
one is not, a page seen before is stored again unless the history has turned out to be a
scan's. :class:`ConversationAdmission` is a mixin of
:class:`~tierkv.policies.kvaware.KVAwarePolicy`, which owns the state it declares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from tierkv.policies.base import NO_HINT, ChainHint, Hints, Key, PageHint, page_hints
from tierkv.policies.history import History

HEAD_PER_PAGES = 750
"""Automatic ``head_blocks``: one head block per this many pages of capacity (8 at 6,000)."""

STEP_BLOCKS = 6
STEP_PER_PAGES = 1000
"""Automatic ``step_blocks``: ``max(STEP_BLOCKS, capacity // STEP_PER_PAGES)`` (6 up to 6,999)."""

SCAN_WARMUP = 2048
SCAN_RATE = 0.02
SCAN_DECAY = 0.999
SCAN_PROBE = 8
"""The scan gate: once :data:`SCAN_WARMUP` pages that came back from the history have left,
if fewer than :data:`SCAN_RATE` of the recent ones (a moving average, weight
:data:`SCAN_DECAY` per page) were used while resident, the history is readmitting a scan that
is longer than the tier: a page that comes back is then declined, except one in
:data:`SCAN_PROBE`, which keeps the measure current (so the gate opens again when the
traffic changes). The conversation trace never closes it (the rate stays at 0.05 or more)."""


class ConversationAdmission:
    """The admission rules of kvaware and the history they read (a mixin).

    The history (``_gone``) remembers departed and declined pages with their use counts; a
    page it holds is admitted again (a conversation's next turn) unless the scan gate is
    closed. A batch of admissions (one request's new pages, asked before any is inserted)
    ends with ``_end_batch``.
    """

    _capacity: int
    _limit: float
    _max_fanout: int
    _short: int
    _head_blocks: int | None
    _step_blocks: int | None
    _gone: History  # departed/declined key -> use count, oldest first
    _pending: dict[Key, int]  # admitted, not yet inserted -> fanout so far
    _run: dict[Key, int]  # this batch's never-seen pages -> depth their run began
    _small: set[Key]  # this batch's admitted small-step pages: they start at 2 uses
    _back_left: float  # the scan gate: pages back from the history that left (decayed)
    _back_used: float  # ... and of them, used while resident
    _back_seen: int
    _probes: int
    _decisions: dict[str, int]  # admission outcomes by rule (see stats)
    _slot_of: Mapping[Key, int]  # the tier's key -> slot map (EvictionPolicy._bind)
    _chain_loop: ChainLoop  # admit_chain, or its C twin (set by the policy)

    if TYPE_CHECKING:  # provided by KVAwarePolicy

        def _fanout_of(self, key: Key) -> int | None: ...

        def _add_fanout(self, key: Key) -> None: ...

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        """Whether a full tier should store ``key`` (see ``KVAwarePolicy``)."""
        if hint is NO_HINT:  # the short way: no parent, not a last block
            return True
        ok = self._judge(
            key,
            hint.depth,
            hint.last,
            hint.prefix_hits,
            hint.parent,
            hint.blocks,
            self._head_rule(),
            self._step_rule(),
        )
        if ok:  # a later page of the batch may extend it
            self._pending.setdefault(key, 0)
        return ok

    def admit_many(self, keys: Sequence[Key], hints: Hints) -> list[bool] | None:
        """:meth:`admit` for a batch, in order; None when every page is admitted. A
        :class:`~tierkv.policies.base.ChainHint` is read block by block, no hint built
        (:func:`admit_chain`, or its C twin)."""
        if hints is None:
            return None
        if isinstance(hints, ChainHint):
            out, every, judged, admitted, lasts, fanned, stepped = self._chain_loop(
                keys,
                hints.depth,
                hints.parent,
                hints.prefix_hits,
                hints.blocks,
                self._head_rule(),
                self._step_rule(),
                not self._scan(),
                self._gone,
                self._run,
                self._pending,
                self._small,
                self._slot_of,
                self._limit,
                self._max_fanout,
                self._short,
                self._judge,
            )
            readmitted = len(out) - out.count(False) - judged - admitted
            decisions = self._decisions
            if readmitted:
                decisions["readmitted"] = decisions.get("readmitted", 0) + readmitted
            for what, count in (
                ("declined_step", stepped),
                ("declined_last", lasts),
                ("admitted", admitted),
                ("declined_fanout", fanned),
            ):
                if count:
                    decisions[what] = decisions.get(what, 0) + count
            return None if every else out
        admit = self.admit
        out = []
        every = True
        for k, h in zip(keys, page_hints(keys, hints)):
            ok = admit(k, h)
            every = every and ok
            out.append(ok)
        return None if every else out

    def stats(self) -> dict[str, float]:
        """What admission decided so far, by rule, and the state it reads.

        ``admitted`` (never-seen pages stored), ``readmitted`` (pages the history held),
        ``declined_history_scan``, ``declined_step``, ``declined_head``, ``declined_fanout``
        (a shared or missing parent), ``declined_last``; ``history`` (keys remembered),
        ``scan_gate_closed`` (0/1), ``returning_used`` (the share of pages back from the
        history that were used before they left, the gate's measure), and the effective
        ``head_blocks`` and ``step_blocks``.
        """
        out: dict[str, float] = dict(self._decisions)
        out["history"] = len(self._gone)
        out["scan_gate_closed"] = int(self._scan())
        out["returning_used"] = self._back_used / self._back_left if self._back_left else 0.0
        out["head_blocks"] = self._head_rule()
        out["step_blocks"] = self._step_rule()
        return out

    def _remember(self, key: Key, count: int) -> None:
        gone = self._gone
        gone.put(key, count)
        gone.trim(self._limit)

    def end_batch(self) -> None:
        """Forget the batch being admitted (a refused store): its pages were never inserted."""
        self._end_batch()

    def _end_batch(self) -> None:
        self._pending.clear()
        if self._run:
            self._run.clear()
            self._small.clear()

    def _head_rule(self) -> int:
        head = self._head_blocks
        return self._capacity // HEAD_PER_PAGES if head is None else head

    def _step_rule(self) -> int:
        step = self._step_blocks
        return max(STEP_BLOCKS, self._capacity // STEP_PER_PAGES) if step is None else step

    def _left(self, used: bool) -> None:
        """A page that came back from the history leaves (evicted): was it used meanwhile?"""
        self._back_left = self._back_left * SCAN_DECAY + 1.0
        self._back_used = self._back_used * SCAN_DECAY + used
        self._back_seen += 1

    def _scan(self) -> bool:
        """True when the history is readmitting a scan (see :data:`SCAN_WARMUP`)."""
        return self._back_seen >= SCAN_WARMUP and self._back_used < SCAN_RATE * self._back_left

    def _judge(
        self,
        key: Key,
        depth: int,
        last: bool,
        hits: int,
        parent: Key | None,
        blocks: int,
        head: int,
        step: int,
    ) -> bool:
        """The admission rules for one page, its hint given field by field (``head`` and
        ``step``: :meth:`_head_rule` and :meth:`_step_rule`, read once per batch)."""
        decisions = self._decisions
        gone = self._gone
        if key in gone:
            if self._scan():
                self._probes += 1
                if self._probes % SCAN_PROBE:
                    gone.touch(key)  # still remembered, as if declined now
                    decisions["declined_history_scan"] = (
                        decisions.get("declined_history_scan", 0) + 1
                    )
                    return False
            decisions["readmitted"] = decisions.get("readmitted", 0) + 1
            return True
        later = hits > 1 and parent is not None and not last
        if later and step:  # a later turn: how many never-seen blocks in a row does it bring?
            start = self._run.get(parent, depth)
            self._run[key] = start
            if blocks - start >= step:
                self._remember(key, 1)
                decisions["declined_step"] = decisions.get("declined_step", 0) + 1
                return False
        if head and hits <= 1 and not last:  # nothing hit past the shared root
            if depth <= head:
                decisions["admitted"] = decisions.get("admitted", 0) + 1
                return True
            if not 0 < blocks <= self._short:
                self._remember(key, 1)
                decisions["declined_head"] = decisions.get("declined_head", 0) + 1
                return False
        if last:
            ok = False
        elif parent is None:
            decisions["admitted"] = decisions.get("admitted", 0) + 1
            return True
        else:
            fanout = self._fanout_of(parent)
            if fanout is not None:  # the parent is resident
                ok = fanout < self._max_fanout or 0 < blocks <= self._short
                self._add_fanout(parent)
            else:
                fanout = self._pending.get(parent)  # admitted earlier in this batch
                if fanout is None:
                    ok = False
                else:
                    ok = fanout < self._max_fanout or 0 < blocks <= self._short
                    self._pending[parent] = fanout + 1
        if not ok:
            self._remember(key, 1)
            what = "declined_last" if last else "declined_fanout"
            decisions[what] = decisions.get(what, 0) + 1
        else:
            decisions["admitted"] = decisions.get("admitted", 0) + 1
            if later and step:
                self._small.add(key)
        return ok


Judge = Callable[[Key, int, bool, int, Key | None, int, int, int], bool]
ChainLoop = Callable[
    [
        Sequence[Key],
        int,
        Key | None,
        int,
        int,
        int,
        int,
        bool,
        History,
        dict[Key, int],
        dict[Key, int],
        set[Key],
        Mapping[Key, int],
        float,
        int,
        int,
        Judge,
    ],
    tuple[list[bool], bool, int, int, int, int, int],
]


def admit_chain(
    keys: Sequence[Key],
    first: int,
    parent: Key | None,
    hits: int,
    blocks: int,
    head: int,
    step: int,
    gate_open: bool,
    gone: History,
    run: dict[Key, int],
    pending: dict[Key, int],
    small_set: set[Key],
    slot_of: Mapping[Key, int],
    limit: float,
    fanout_max: int,
    short: int,
    judge: Judge,
) -> tuple[list[bool], bool, int, int, int, int, int]:
    """The admission of a :class:`~tierkv.policies.base.ChainHint`'s run (``keys`` from
    depth ``first``), block by block as :meth:`ConversationAdmission._judge` would judge each,
    with the common cases written out and the rest passed to ``judge``. Returns the verdicts,
    whether all are yes, and the counts of pages judged by ``judge`` and admitted, declined as
    last blocks, for their fan-out and as a large step here (the caller books them).

    The reference of the C twin (``policies/_kvaware.c``, ``admit_chain``)."""
    out: list[bool] = []
    every = True
    last = blocks - 1
    stepped = 0
    settle, append = pending.setdefault, out.append
    remember, trim, get, remembered = gone.put, gone.trim, run.get, gone.value
    big = step and hits > 1  # a later turn under the step rule
    small = small_set.add
    judged = admitted = lasts = fanned = 0  # pages decided here, as _judge would
    fresh = False  # the page before was admitted here (pending, not yet resident)
    for depth, k in enumerate(keys, first):
        if k in remembered:
            if gate_open:  # readmitted, as _judge would (the gate is open)
                settle(k, 0)
                append(True)
                parent = k
                fresh = True
                continue
            ok = judge(k, depth, depth == last, hits, parent, blocks, head, step)
        elif depth == last:  # a never-seen last block: declined, as _judge would
            remember(k, 1)
            trim(limit)
            lasts += 1
            every = False
            append(False)
            parent = k
            fresh = False
            continue
        elif big and parent is not None:  # a later turn's never-seen block
            start = get(parent, depth)
            run[k] = start
            if blocks - start >= step:  # a large step: declined and remembered
                remember(k, 1)
                trim(limit)
                stepped += 1
                every = False
                append(False)
                parent = k
                fresh = False
                continue
            if fresh and parent not in slot_of:  # a small step off the page before
                fan = pending[parent]
                pending[parent] = fan + 1
                if fan < fanout_max or 0 < blocks <= short:
                    admitted += 1
                    small(k)
                    settle(k, 0)
                    append(True)
                    parent = k
                    continue
                remember(k, 1)
                trim(limit)
                fanned += 1
                every = False
                append(False)
                parent = k
                fresh = False
                continue
            ok = judge(k, depth, False, hits, parent, blocks, head, step)
        else:
            ok = judge(k, depth, False, hits, parent, blocks, head, step)
        if ok:
            settle(k, 0)
            judged += 1
        else:
            every = False
        append(ok)
        parent = k
        fresh = ok
    return out, every, judged, admitted, lasts, fanned, stepped
