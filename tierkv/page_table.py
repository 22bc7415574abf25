"""The page table: which tier holds each page, in what state, with how many pins.

The contract follows the two-phase moves of vLLM's offloading manager::

    lookup(keys, tier)            -> length of the longest resident (readable) prefix
    prepare_load(keys, tier)      -> slots; pins every page (pinned pages are never evicted)
    pin_readable(keys, tier)      -> (pinned, rest): prepare_load of the readable ones
    complete_load(keys, tier)     unpins, records the use
    prepare_store(keys, tier)     -> StoreAllocation (evicting by policy), or None when there is
                                     no room because everything else is pinned / moving / writing
    complete_store(keys, tier, ok) commits (WRITING -> READABLE) or rolls back; keys that are
                                     not WRITING are passed over (completing twice is fine)
    prepare_evict(tier, n)        -> victims, marked MOVING (for a write-back to a lower tier)
    complete_evict(keys, tier, ok) drops them (or puts them back exactly where they were)
    touch(keys, tier)             records uses; keys the tier does not hold are passed over
                                     (the policy hears of them as misses: ARC's ghost feedback)
    candidates(tier, n)           the next victims, without changing anything
    remove(keys, tier) / rekey(old, new, tier) / take_events()

A page's life in one tier::

    prepare_store        complete_store(ok)         prepare_evict        complete_evict(ok)
   ───────────> WRITING ───────────────────> READABLE ───────────> MOVING ──────────────> gone
                   │ complete_store(not ok)    │  ▲  prepare_load/complete_load: pins    ▲
                   └──────────> gone           │  └── complete_evict(not ok) ───────────┘
                                               └── evicted by policy (unpinned only) ──> gone

Misuse (an unknown key, unpinning an unpinned page, a page in the wrong state) raises a
:class:`~tierkv.errors.PageTableError` subclass *before* anything changes; so does a policy that
breaks its contract (too few victims: :class:`~tierkv.errors.TierKVError`, after its victims are
put back). A tier of capacity 0 is legal (offload disabled): it stores nothing. The whole
contract, call by call, is in ``docs/policies.md``.

The file stays whole (over 400 lines) because it is the one owner of page state: every change
of state, pins and slots is here, where :meth:`PageTable.check` can be read against it.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from itertools import compress, repeat
from operator import itemgetter, not_
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from tierkv.errors import (
    InvalidInputError,
    InvalidTypeError,
    PageStateError,
    PinError,
    TierKVError,
    UnknownPageError,
)
from tierkv.evict_order import OrderIndex
from tierkv.page_sums import PageSums
from tierkv.policies import DEFAULT_POLICY, EvictionPolicy, Key, PageHint, create_policy
from tierkv.policies.base import CanEvictSlot, ChainHint, ChainPart, Hints, page_hints
from tierkv.slot_pins import SMALL, add_pins, drop_pins, set_states
from tierkv.tenant_counts import MIXED, QUOTA

if TYPE_CHECKING:
    from tierkv.tenant_counts import TierCounts
    from tierkv.tenants import Tenants


class PageState(IntEnum):
    """State of a page in one tier."""

    WRITING = 0
    READABLE = 1
    MOVING = 2


MAX_PAGES = 1 << 28
"""The most pages a tier holds: the table and its policy keep ~90 bytes of Python bookkeeping
a page (2**28 pages: ~24 GiB), allocated at once. A budget in the wrong unit
(``device_bytes=1 << 40`` with 512-byte pages: 2**31 pages) took 20 s of opening per 2**27
pages, then the kernel's OOM killer, not an error."""

_WRITING, _READABLE, _MOVING = (int(s) for s in PageState)
_NONE_TAKEN: Mapping[int | None, int] = MappingProxyType({})  # (no victims taken yet)


@dataclass(frozen=True, slots=True)
class StoreAllocation:
    """What :meth:`PageTable.prepare_store` reserved.

    Attributes:
        tier: the tier written to.
        keys: pages to write, in request order (now WRITING).
        slots: the tier slot of each page in ``keys``.
        evicted: pages dropped from the tier to make room (their slots are reused).
        present: pages already in the tier (nothing to write).
        rejected: pages the policy declined to admit (not stored).
    """

    tier: str
    keys: list[Key]
    slots: list[int]
    evicted: list[Key]
    present: list[Key]
    rejected: list[Key]


@dataclass(frozen=True, slots=True)
class Placement:
    """What :meth:`PageTable.place` did: ``pinned``, the pages that were readable in the tier
    (pinned now); ``new``, the rest, WRITING in the tier's ``slots``, their copies in the
    source tier pinned at ``src_slots``; ``dropped``, the victims that left for their room."""

    pinned: list[Key]
    new: list[Key]
    slots: list[int]
    src_slots: list[int]
    dropped: int


@dataclass(frozen=True, slots=True)
class PageEvent:
    """An observable change: ``kind`` is ``"stored"``, ``"evicted"`` or ``"removed"``."""

    kind: str
    tier: str
    keys: tuple[Key, ...]


def _by_rules(
    acc: Tenants,
    tier: str,
    n: int,
    taken: Mapping[int | None, int],
    by: int | None,
    pick: Callable[[int, Callable[[Key], bool] | None], int],
) -> int:
    """Up to ``n`` victims in ``tier`` for tenant ``by``'s pages by the quotas' rules: rule 1's
    passes, then rule 2's (:meth:`Tenants.room` says how many and which), each taken by
    ``pick(count, allow)`` (returns how many it took), until ``n`` or a pass that finds too
    few. Returns how many in all."""
    got = 0
    for over in (True, False):
        while got < n:
            ask = acc.room(tier, n - got, over, taken, by)
            if ask is None:
                break
            k, allow = ask
            m = pick(k, allow)
            got += m
            if m < k:
                break
    return got


class _Tier:
    """One tier's pages. A page *is* its slot: state, pins and key live in per-slot arrays, so
    the table allocates no object per page (which also keeps the garbage collector idle)."""

    __slots__ = (
        "acc",
        "admits",
        "capacity",
        "free",
        "key_of",
        "moving",
        "name",
        "order",
        "pins",
        "policy",
        "quota",
        "slot_of",
        "state",
        "undo",
        "unevictable",
    )

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy) -> None:
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.admits = policy.admits  # skip a no-op call per batch
        self.slot_of: dict[Key, int] = {}
        # per-slot state in containers the garbage collector neither tracks nor walks (a list
        # of a million ints or keys costs every full pass ~10 ms once its items are distinct
        # objects): key_of is a dict of used slots (of atomic keys: untracked), the rest arrays
        self.key_of: dict[int, Key] = {}
        self.state = bytearray([_READABLE]) * capacity
        self.pins = array("l", [0]) * capacity
        self.free = array("l", range(capacity - 1, -1, -1))
        self.unevictable = 0  # pages that are pinned, WRITING or MOVING
        self.moving = 0  # MOVING pages (they have left the policy)
        self.undo: dict[int, object] = {}  # MOVING slot -> what the policy needs to put it back
        self.order: OrderIndex | None = None  # positions in the last order evictions followed
        self.acc: TierCounts | None = None  # the tenants' counts of this tier (None: none)
        # per MOVING slot, the tenant whose room it was chosen for (-1: none), with tenants
        self.quota = False  # whether evictions here must keep the tenants' quotas
        policy.bind_slots(capacity, self.slot_of)


class PageTable:
    """Pages across named tiers, each with a capacity in pages and its own eviction policy.

    Args:
        tiers: tier name -> capacity in pages, highest tier first (e.g.
            ``{"device": 512, "host": 8192}``).
        policy: a policy name for every tier, or a mapping tier name -> policy name.
        record_events: keep stored/evicted events for :meth:`take_events`.
        encoded: tiers whose copies are encoded (cold): :attr:`sums` keeps a checksum of the
            payload in each of their slots.
        tenants: the tenants' accounting (:class:`tierkv.tenants.Tenants`): told of every page
            arriving and leaving, asked which pages each eviction may take (their quotas); an
            eviction that cannot free its room within them takes nothing (see
            :meth:`quota_blocked`).

    Pages' checksums (:attr:`sums`, a :class:`~tierkv.page_sums.PageSums`) are this table's: a
    page's goes when the page leaves its last tier, and follows it through :meth:`rekey`.

    Raises:
        InvalidInputError: no tiers, or a capacity below 0 (a ValueError).
        UnknownPolicyError: an unknown policy name (an InvalidInputError too).
    """

    def __init__(
        self,
        tiers: Mapping[str, int],
        policy: str | Mapping[str, str] = DEFAULT_POLICY,
        *,
        record_events: bool = True,
        encoded: Collection[str] = (),
        tenants: Tenants | None = None,
    ) -> None:
        if not isinstance(tiers, Mapping):  # (a list of pairs was an AttributeError)
            raise InvalidTypeError(f"tiers: a dict of name -> capacity, got {type(tiers).__name__}")
        if not tiers:
            raise InvalidInputError("a page table needs at least one tier")
        self._tiers: dict[str, _Tier] = {}
        for name, cap in tiers.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_PAGES:
                raise InvalidInputError(
                    f"tier {name!r}: capacity must be an int in [0, {MAX_PAGES}], got {cap!r:.40}"
                )
            pol = policy if isinstance(policy, str) else policy.get(name, DEFAULT_POLICY)
            self._tiers[name] = _Tier(name, cap, create_policy(pol))
        self._record = record_events
        self._events: list[PageEvent] = []
        self.sums = PageSums({t: tiers[t] for t in encoded})
        self._acc = tenants
        if tenants is not None:
            tenants.bind(self.held)  # (it prunes the charges of pages no tier holds)
            for t in self._tiers.values():
                t.acc = tenants.counts(t.name)
                t.quota = t.name in tenants.active_tiers
                if t.acc is not None:  # (each slot remembers its MOVING page's cause)
                    t.acc.bind_slots(t.capacity)
        # tiers whose last eviction the quotas cut short -> the tenant it was for (or None)
        self._blocked: dict[str, int | None] = {}

    # -- introspection -------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        """Tier names, highest first."""
        return list(self._tiers)

    def capacity(self, tier: str) -> int:
        """Capacity of ``tier`` in pages."""
        return self._tier(tier).capacity

    def used(self, tier: str) -> int:
        """Pages held by ``tier`` in any state."""
        return len(self._tier(tier).slot_of)

    def evictable(self, tier: str) -> int:
        """Pages of ``tier`` that the policy may evict now (readable and unpinned)."""
        t = self._tier(tier)
        return len(t.slot_of) - t.unevictable

    def policy(self, tier: str) -> EvictionPolicy:
        """The eviction policy of ``tier``."""
        return self._tier(tier).policy

    def tiers_of(self, key: Key) -> list[str]:
        """Names of the tiers that hold ``key`` (in any state), highest first."""
        return [t.name for t in self._tiers.values() if key in t.slot_of]

    def state(self, key: Key, tier: str) -> PageState:
        """State of ``key`` in ``tier``. Raises UnknownPageError."""
        t = self._tier(tier)
        return PageState(t.state[self._slot(t, key)])

    def pins(self, key: Key, tier: str) -> int:
        """Pin count of ``key`` in ``tier``. Raises UnknownPageError."""
        t = self._tier(tier)
        return t.pins[self._slot(t, key)]

    def slot(self, key: Key, tier: str) -> int:
        """Slot of ``key`` in ``tier``. Raises UnknownPageError."""
        t = self._tier(tier)
        return self._slot(t, key)

    def slots(self, keys: Sequence[Key], tier: str) -> list[int]:
        """Slots of ``keys`` in ``tier``, in order. Raises UnknownPageError."""
        return self._slots(self._tier(tier), keys)

    def keys(self, tier: str) -> list[Key]:
        """Every key held by ``tier``."""
        return list(self._tier(tier).slot_of)

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key], tier: str | None = None) -> int:
        """Length of the longest prefix of ``keys`` readable in ``tier`` (any tier if None)."""
        if tier is not None:
            t = self._tier(tier)
            slot_of, state = t.slot_of, t.state
            if len(keys) > 1:  # the whole run resident and readable: two C-level passes
                try:
                    slots = itemgetter(*keys)(slot_of)
                except KeyError:
                    pass
                else:
                    if itemgetter(*slots)(state).count(_READABLE) == len(slots):
                        return len(slots)
            n = 0
            for k in keys:
                s = slot_of.get(k)
                if s is None or state[s] != _READABLE:
                    break
                n += 1
            return n
        tiers = [(t.slot_of, t.state) for t in self._tiers.values()]
        n = 0
        for k in keys:
            for slot_of, state in tiers:
                s = slot_of.get(k)
                if s is not None and state[s] == _READABLE:
                    break
            else:
                break
            n += 1
        return n

    def present(self, keys: Iterable[Key], tier: str) -> list[Key]:
        """The keys (in order) that ``tier`` holds in any state."""
        slot_of = self._tier(tier).slot_of
        return [k for k in keys if k in slot_of]

    def absent(self, keys: Iterable[Key], tier: str) -> list[Key]:
        """The keys (in order) that ``tier`` does not hold in any state."""
        slot_of = self._tier(tier).slot_of
        return [k for k in keys if k not in slot_of]

    def readable(self, keys: Iterable[Key], tiers: str | Sequence[str]) -> list[Key]:
        """The keys (in order) readable in ``tiers`` (one tier, or in at least one of several):
        the batch form of :meth:`lookup` on one key."""
        if isinstance(tiers, str):
            t = self._tier(tiers)
            get, state = t.slot_of.get, t.state
            return [k for k in keys if (s := get(k)) is not None and state[s] == _READABLE]
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        found: set[Key] = set()
        rest = keys
        for name in tiers:  # one C-speed pass per tier, no generator per key
            here = self.readable(rest, name)
            if len(here) == len(keys):
                return here  # all in the first tier (the common case): no merge
            found.update(here)
            rest = [k for k in rest if k not in found]
            if not rest:
                break
        return [k for k in keys if k in found]

    def idle(self, keys: Iterable[Key], tier: str) -> list[Key]:
        """The keys (in order) that ``tier`` holds readable and unpinned."""
        t = self._tier(tier)
        get, state, pins = t.slot_of.get, t.state, t.pins
        return [
            k for k in keys if (s := get(k)) is not None and state[s] == _READABLE and not pins[s]
        ]

    def held(self, keys: Iterable[Key]) -> list[Key]:
        """The keys (in order) that some tier holds in any state."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        found: set[Key] = set()
        for t in self._tiers.values():  # one pass per tier, no generator per key
            slot_of = t.slot_of
            found.update([k for k in keys if k in slot_of])
        return [k for k in keys if k in found]

    def lookup_tiers(self, keys: Sequence[Key]) -> dict[str, int]:
        """:meth:`lookup` for every tier."""
        return {name: self.lookup(keys, name) for name in self._tiers}

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[Key], tier: str) -> list[int]:
        """Pin readable pages for reading; returns their slots.

        Raises:
            UnknownPageError: a key is not in the tier.
            PageStateError: a page is not readable (still being written, or moving).
        """
        t = self._tier(tier)
        slots = self._slots(t, keys)
        state, pins = t.state, t.pins
        if _count(state, slots, _READABLE) != len(slots):
            self._raise_state(t, keys, slots, _READABLE)
        t.unevictable += add_pins(pins, slots)
        return slots

    def pin_readable(self, keys: Sequence[Key], tier: str) -> tuple[list[Key], list[Key]]:
        """:meth:`readable` and :meth:`prepare_load` of those in one pass: pins the pages of
        ``keys`` readable in ``tier``; returns ``(pinned, rest)``, each in the order of
        ``keys``. Raises UnknownPageError only for an unknown tier."""
        t = self._tier(tier)
        if len(keys) < SMALL:  # a few pages: numpy's setup costs more than the loop
            get, state = t.slot_of.get, t.state
            pinned = [k for k in keys if (s := get(k)) is not None and state[s] == _READABLE]
            if len(pinned) < len(keys):
                ready = set(pinned)
                rest = [k for k in keys if k not in ready]
            else:
                rest = []
            t.unevictable += add_pins(t.pins, [t.slot_of[k] for k in pinned])
            return pinned, rest
        slots = np.fromiter(map(t.slot_of.get, keys, repeat(-1)), np.intp, len(keys))
        ok = slots >= 0
        ok[ok] = np.frombuffer(t.state, dtype=np.uint8)[slots[ok]] == _READABLE
        if ok.all():
            pinned, rest = list(keys), []
        else:
            flags = ok.tolist()
            pinned = list(compress(keys, flags))
            rest = list(compress(keys, map(not_, flags)))
            slots = slots[ok]
        t.unevictable += add_pins(t.pins, slots.tolist())
        return pinned, rest

    def complete_load(self, keys: Sequence[Key], tier: str) -> None:
        """Unpin pages pinned by :meth:`prepare_load` and record their use.

        Raises:
            UnknownPageError: a key is not in the tier.
            PinError: a page is not pinned (as often as ``keys`` names it).
        """
        t = self._tier(tier)
        slots = self._slots(t, keys)
        state, pins = t.state, t.pins
        bad, freed = drop_pins(pins, slots, state, _READABLE)
        if bad is not None:
            raise PinError(f"page {_show(keys[bad])} in tier {tier!r} is not pinned")
        t.unevictable -= freed
        t.policy.touch_slots(slots, keys)

    def touch(self, keys: Iterable[Key], tier: str) -> None:
        """Record a use of resident pages, in order. Pages the tier does not hold are passed
        over and reported to the policy as misses (:meth:`EvictionPolicy.miss`: ARC takes ghost
        feedback from them), as vLLM's and LMCache's managers do; MOVING ones, already on their
        way out, are passed over. Raises UnknownPageError only for an unknown tier."""
        t = self._tier(tier)
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            slots = self._slots(t, keys)
        except UnknownPageError:
            slot_of = t.slot_of
            t.policy.miss([k for k in keys if k not in slot_of])
            keys = [k for k in keys if k in slot_of]
            slots = [slot_of[k] for k in keys]
        if t.moving:
            state = t.state
            keys = [k for k, s in zip(keys, slots) if state[s] != _MOVING]
            slots = [s for s in slots if state[s] != _MOVING]
        t.policy.touch_slots(slots, keys)

    # -- stores --------------------------------------------------------------------------
    def prepare_store(
        self,
        keys: Sequence[Key],
        tier: str,
        hints: Sequence[PageHint] | ChainHint | None = None,
    ) -> StoreAllocation | None:
        """Reserve slots for the pages of ``keys`` not yet in ``tier``, evicting by policy.

        Pages already present are reported in ``present`` (call :meth:`touch` to record a
        use); they, and the new pages, are never chosen as victims. New pages are WRITING until
        :meth:`complete_store`.

        ``hints``: one :class:`PageHint` per key, or one :class:`ChainHint` when ``keys`` are
        consecutive blocks of one request's chain (the table derives each page's hint from
        its place in ``keys``: no object per block), or None.

        Returns:
            The allocation, or ``None`` when the tier cannot make room because too many pages
            are pinned, moving or being written (nothing changed then).

        Raises:
            InvalidInputError: ``hints`` and ``keys`` differ in length (a ValueError).
        """
        t = self._tier(tier)
        chain = isinstance(hints, ChainHint)
        if hints is not None and not chain and len(hints) != len(keys):  # type: ignore[arg-type]
            raise InvalidInputError(f"{len(hints)} hints for {len(keys)} keys")  # type: ignore[arg-type]
        slot_of, state, pins = t.slot_of, t.state, t.pins
        present: list[Key] = []
        new: list[Key]
        new_hints: Hints
        if not any(map(slot_of.__contains__, keys)) and len(set(keys)) == len(keys):
            new = list(keys)  # the common case: distinct pages, none resident
            new_hints = hints
        else:
            batch = dict.fromkeys(keys)  # distinct keys, in order
            new = [k for k in batch if k not in slot_of]
            present = [k for k in batch if k in slot_of]
            if hints is None:
                new_hints = None
            else:
                hint_of: dict[Key, PageHint] = {}
                for k, h in zip(keys, page_hints(keys, hints)):
                    hint_of.setdefault(k, h)
                new_hints = [hint_of[k] for k in new]
        rejected: list[Key] = []
        free = t.free
        need = len(new) - len(free)
        if need > 0:
            if t.admits:
                kept = t.policy.admit_many(new, new_hints)
                if kept is not None:
                    rejected = list(compress(new, map(not_, kept)))
                    if isinstance(new_hints, ChainHint):  # the rest is no chain: a part
                        new_hints = ChainPart(new_hints, new, kept)
                    elif new_hints is not None:
                        new_hints = [h for h, ok in zip(page_hints(new, new_hints), kept) if ok]
                    new = list(compress(new, kept))
                    need = len(new) - len(free)
            protected = 0
            for k in present:
                s = slot_of[k]
                if not pins[s] and state[s] == _READABLE:
                    protected += 1
            if need > len(slot_of) - t.unevictable - protected:
                if t.admits:  # the batch admission judged is not stored after all
                    t.policy.end_batch()
                return None
        evicted: list[Key] = []
        if need > 0:
            got = self._evict(t, need, present, new)
            if got is None:  # no room within the tenants' quotas: nothing changed
                if t.admits:
                    t.policy.end_batch()
                return None
            evicted = got
            if self._record:
                self._events.append(PageEvent("evicted", tier, tuple(evicted)))
        cut = len(free) - len(new)
        slots = free[cut:].tolist()
        del free[cut:]
        slot_of.update(zip(new, slots))
        t.key_of.update(zip(slots, new))
        set_states(state, slots, _WRITING)
        if t.order is not None:
            t.order.placed(slots, new)
        t.policy.insert_slots(slots, new, new_hints)
        t.unevictable += len(new)
        if t.acc is not None:  # one call: the victims out (caused by new's maker), new in
            t.acc.replaced(evicted, new)
        return StoreAllocation(tier, new, slots, evicted, present, rejected)

    def _evict(
        self, t: _Tier, n: int, present: list[Key], new: Sequence[Key] = ()
    ) -> list[Key] | None:
        """Evict ``n`` pages by policy (never those of ``present``); their slots go free.
        None (nothing changed) when the tenants' quotas leave fewer than ``n`` to take."""
        slot_of, state, pins, key_of = t.slot_of, t.state, t.pins, t.key_of
        can_evict: CanEvictSlot | None = None  # None: nothing pinned, moving or protected
        keep: set[int] = set()
        if present:
            keep = set(self._slots(t, present))
            can_evict = lambda s: not pins[s] and state[s] == _READABLE and s not in keep  # noqa: E731
        elif t.unevictable:
            can_evict = lambda s: not pins[s] and state[s] == _READABLE  # noqa: E731
        acc, counts = self._acc, t.acc
        if t.quota and acc is not None and counts is not None and not counts.any_pick(n):
            got = self._quota_victims(t, n, keep, acc, counts.shares(new, n))
            if got is None:
                return None
            slots = got
        else:
            slots = t.policy.evict_slots(n, can_evict)
            if self._blocked:
                self._blocked.pop(t.name, None)
        evicted = [key_of[s] for s in slots]
        self._check_victims(t, n, slots, evicted)
        for k in evicted:
            del slot_of[k]
        if t.order is not None:
            t.order.freed(slots)
        t.free.extend(slots)  # the caller takes every free slot at once: no key_of reset
        self._forget(evicted)  # (the tenants are told with the pages stored: replaced)
        return evicted

    def _quota_victims(
        self,
        t: _Tier,
        n: int,
        keep: set[int],
        acc: Tenants,
        shares: list[tuple[int | None, int]],
    ) -> list[int] | None:
        """``n`` victim slots by policy within the tenants' quotas (rule 1, then rule 2 of
        :mod:`tierkv.tenants`) for new pages, taken from the policy but not yet from the
        table; None (the policy's state put back) when there are fewer. ``shares``: the
        evictions per tenant they are for (:meth:`TierCounts.shares`; several for pages of
        several tenants, each asked for on its own, so that rule 2 lets each tenant's pages
        go only for its own new pages)."""
        pins, state, key_of = t.pins, t.state, t.key_of
        if len(shares) == 1 and not acc.over_limit(t.name):  # the policy's own pick first:
            by = shares[0][0]  # most keep the quotas

            def free(s: int) -> bool:
                return not pins[s] and state[s] == _READABLE and s not in keep

            slots = t.policy.evict_slots(n, free if t.unevictable or keep else None)
            keys = [key_of[s] for s in slots]
            if len(slots) == n and acc.keeps_reserves(t.name, keys, by, counted=False):
                self._blocked.pop(t.name, None)
                return slots
            if slots:  # it would take a tenant below its reservation: put back, pick by rule
                t.policy.restore_slots(slots, keys, t.policy.evicted_state_slots(slots, keys))
        passes: list[tuple[list[int], list[object]]] = []
        taken: Counter[int | None] = Counter()
        for by, want in shares:
            if self._rule_victims(t, want, keep, acc, by, taken, passes) < want:
                for slots, states in reversed(passes):  # the policy's state as it was
                    if slots:
                        t.policy.restore_slots(slots, [key_of[s] for s in slots], states)
                self._blocked[t.name] = by
                acc.blocked(by)
                return None
        self._blocked.pop(t.name, None)
        return [s for slots, _ in passes for s in slots]

    def _rule_victims(
        self,
        t: _Tier,
        n: int,
        keep: set[int],
        acc: Tenants,
        by: int | None,
        taken: Counter[int | None],
        passes: list[tuple[list[int], list[object]]],
    ) -> int:
        """Up to ``n`` victim slots for tenant ``by``'s pages by the quotas' rules, taken
        from the policy (appended to ``passes`` with their states, counted in ``taken``);
        returns how many."""
        pins, state, key_of = t.pins, t.state, t.key_of

        def pick(k: int, allow: Callable[[Key], bool] | None) -> int:
            def ok(s: int) -> bool:
                return (
                    not pins[s]
                    and state[s] == _READABLE
                    and s not in keep
                    and (allow is None or allow(key_of[s]))
                )

            slots = t.policy.evict_slots(k, ok)
            keys = [key_of[s] for s in slots]
            passes.append((slots, t.policy.evicted_state_slots(slots, keys)))
            taken.update(acc.tally(keys))
            return len(slots)

        return _by_rules(acc, t.name, n, taken, by, pick)

    def quota_blocked(self, tier: str) -> bool:
        """Whether the last eviction from ``tier`` that the tenants' quotas constrained found
        too few pages within them (an admission then waits or refuses with
        QuotaExceededError)."""
        return tier in self._blocked

    def quota_refused(self, tier: str) -> str | None:
        """The tenant whose pages the last eviction from ``tier`` cut short by the quotas was
        for (:meth:`quota_blocked`), or None (no such eviction, or pages of nobody's)."""
        by = self._blocked.get(tier)
        return None if by is None or self._acc is None else self._acc.names[by]

    @staticmethod
    def _order(t: _Tier, order: Sequence[Key]) -> OrderIndex:
        """The places of ``t``'s pages in ``order`` (built when the order is new)."""
        if t.order is None or t.order.order is not order:
            t.order = OrderIndex(order, t.capacity, t.key_of)
        return t.order

    @staticmethod
    def _check_victims(t: _Tier, n: int, slots: list[int], keys: list[Key]) -> None:
        if len(slots) == n:
            return
        # The policy disagrees with our count (a policy bug): put its victims back, then say so.
        if slots:
            t.policy.restore_slots(slots, keys, t.policy.evicted_state_slots(slots, keys))
        raise TierKVError(
            f"policy {t.policy.name!r} found {len(slots)} of {n} victims in {t.name!r} "
            "(nothing was changed)"
        )

    def complete_store(self, keys: Sequence[Key], tier: str, ok: bool = True) -> None:
        """Commit (``ok``) or roll back pages reserved by :meth:`prepare_store`.

        Only WRITING pages change: keys that are READABLE (or already MOVING on, written back)
        are passed over either way, as in vLLM's offloading managers, so a connector may
        complete the whole list it prepared, present pages included, or complete twice; a key
        named twice counts once.

        Raises:
            UnknownPageError: a key is not in the tier (nothing changes).
        """
        t = self._tier(tier)
        slots = self._slots(t, keys)
        state = t.state
        if _count(state, slots, _WRITING) != len(slots) or len(set(slots)) != len(slots):
            writing = dict.fromkeys((k, s) for k, s in zip(keys, slots) if state[s] == _WRITING)
            keys = [k for k, _ in writing]
            slots = [s for _, s in writing]
        if ok:
            state = t.state
            for s in slots:
                state[s] = _READABLE
            if self._record and slots:
                self._events.append(PageEvent("stored", tier, tuple(keys)))
        else:
            self._drop(t, keys, slots)
        t.unevictable -= len(slots)

    # -- a group of pages placed at once -----------------------------------------------------
    def place(
        self,
        keys: Sequence[Key],
        tier: str,
        src: str,
        *,
        loadable: Callable[[int], bool],
        clean: Callable[[list[Key]], bool],
        keep: Collection[Key] | None = None,
        keep_order: Sequence[Key] | None = None,
    ) -> Placement | None:
        """Pin the pages of ``keys`` (distinct) in ``tier``, placing those it does not hold, in
        one call: what :meth:`pin_readable`, :meth:`prepare_evict` with
        :meth:`complete_evict`, :meth:`prepare_store` and :meth:`prepare_load` on ``src`` do for
        a step group's load, with the tenants' counts told as those calls tell them.

        The pages readable in ``tier`` are pinned. The rest (``new``) must be absent from it,
        readable in ``src`` and ``loadable(len(new))`` (the caller's copy can run at once);
        their room is taken from free slots, then from victims by policy (exact, ``keep`` only
        when no other page can go, the last of ``keep_order`` first, as :meth:`prepare_evict`)
        that ``clean(victims)`` accepts: those are dropped. The new pages are WRITING in new
        slots, their ``src`` copies pinned for reading. End with :meth:`land`.

        Returns the placement, or None where it would need a wait, with nothing changed: a
        page in flight (in ``tier`` but not readable), one not readable in ``src``, not
        ``loadable``, too few victims or some not ``clean`` (put back where they were).

        Raises:
            UnknownPageError: an unknown tier (nothing changes).
            TierKVError: the policy broke its contract (nothing pinned is left).
        """
        t = self._tier(tier)
        h = self._tier(src)
        pinned, new = self.pin_readable(keys, tier)
        if not new:
            return Placement(pinned, [], [], [], 0)
        slot_of = t.slot_of
        n = len(new)
        hget, hstate = h.slot_of.get, h.state
        ok = (
            not any(map(slot_of.__contains__, new))  # (none in flight)
            and all((s := hget(k)) is not None and hstate[s] == _READABLE for k in new)
            and loadable(n)
        )
        need = n - len(t.free)
        dropped: list[Key] = []
        try:
            if ok and need > 0:
                got = self._drop_clean(t, need, clean, keep, keep_order, new)
                ok = got is not None
                dropped = got or []
        except BaseException:
            if pinned:
                self.complete_load(pinned, tier)
            raise
        if not ok:
            if pinned:
                self.complete_load(pinned, tier)
            return None
        free = t.free  # room made: the new pages take free slots (prepare_store's, no eviction)
        cut = len(free) - n
        slots = free[cut:].tolist()
        del free[cut:]
        slot_of.update(zip(new, slots))
        t.key_of.update(zip(slots, new))
        set_states(t.state, slots, _WRITING)
        if t.order is not None:
            t.order.placed(slots, new)
        t.policy.insert_slots(slots, new, None)
        t.unevictable += n
        if t.acc is not None:
            t.acc.replaced([], new)
        src_slots = [h.slot_of[k] for k in new]
        h.unevictable += add_pins(h.pins, src_slots)
        return Placement(pinned, new, slots, src_slots, len(dropped))

    def _drop_clean(
        self,
        t: _Tier,
        n: int,
        clean: Callable[[list[Key]], bool],
        keep: Collection[Key] | None,
        keep_order: Sequence[Key] | None,
        for_keys: Sequence[Key],
    ) -> list[Key] | None:
        """:meth:`place`'s room: ``n`` victims as :meth:`prepare_evict` (exact) picks them,
        dropped where ``clean`` accepts them all; None, nothing changed, where not. With no
        tenants and every page of the tier in ``keep_order`` (a step's announced pages), the
        order alone picks them, and they leave the policy only once accepted (no MOVING
        state and put-back in between)."""
        if n > len(t.slot_of) - t.unevictable:
            return None
        if self._acc is None and keep_order:
            order = self._order(t, keep_order)
            only = order.latest_of_all(n, t.state, t.pins, _READABLE, len(t.slot_of))
            if only is not None:
                if len(only) < n or not clean([t.key_of[s] for s in only]):
                    return None
                slots = t.policy.evict_chosen(only)
                keys = list(map(t.key_of.__getitem__, slots))
                self._check_victims(t, n, slots, keys)
                slot_of, key_of = t.slot_of, t.key_of
                deque(map(slot_of.__delitem__, keys), 0)
                deque(map(key_of.__delitem__, slots), 0)
                t.free.extend(slots)
                order.freed(slots)
                self._forget(keys)
                if self._record:
                    self._events.append(PageEvent("evicted", t.name, tuple(keys)))
                return keys
        victims = self.prepare_evict(
            t.name, n, exact=True, keep=keep, keep_order=keep_order, for_keys=for_keys
        )
        dropped = [k for k, _ in victims]
        if len(dropped) < n:
            return None
        if not clean(dropped):  # (a write-back first: not here)
            self._put_back(t, dropped)
            return None
        self.complete_evict(dropped, t.name)
        return dropped

    def land(self, placed: Placement, tier: str, src: str, ok: bool = True) -> None:
        """End a placement's copies (:meth:`place`): the source copies unpinned, and the new
        pages committed and pinned for the caller (``ok``: :meth:`complete_store` then
        :meth:`prepare_load`), or dropped with the caller's pins of the others (not ``ok``)."""
        t = self._tier(tier)
        new, slots = placed.new, placed.slots
        if new:
            self.complete_load(new, src)
        if not ok:
            if new:
                self.complete_store(new, tier, ok=False)
            if placed.pinned:
                self.complete_load(placed.pinned, tier)
            return
        if not new:
            return
        if self._slots(t, new) != slots or _count(t.state, slots, _WRITING) != len(slots):
            self.complete_store(new, tier)  # (changed since: the calls' own checks)
            self.prepare_load(new, tier)
            return
        state = t.state  # WRITING -> READABLE and pinned: unevictable either way
        set_states(state, slots, _READABLE)
        add_pins(t.pins, slots)
        if self._record:
            self._events.append(PageEvent("stored", tier, tuple(new)))

    # -- moves down ----------------------------------------------------------------------
    def prepare_evict(
        self,
        tier: str,
        n: int,
        *,
        exact: bool = False,
        keep: Collection[Key] | None = None,
        keep_order: Sequence[Key] | None = None,
        for_keys: Sequence[Key] = (),
    ) -> list[tuple[Key, int]]:
        """Choose up to ``n`` victims by policy and mark them MOVING; returns (key, slot) pairs.

        Use it to write pages back to a lower tier before they leave this one. With ``exact``
        it is all or nothing: fewer than ``n`` evictable pages give ``[]`` and change nothing.
        ``keep``: pages to evict only when no other page can go (for example the pages of the
        steps a server announced: the schedule outranks the policy); the policy ranks them
        among themselves, unless ``keep_order`` lists them soonest needed first: then the
        last of it goes first. ``for_keys``: the pages the room is for (their tenant is the
        cause of the evictions and of a refusal, under tenants' quotas).

        Raises:
            InvalidInputError: ``n`` is negative (a ValueError).
            TierKVError: the policy broke its contract (nothing was changed).
        """
        t = self._tier(tier)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError(f"prepare_evict needs a count >= 0, got {n!r}")
        evictable = len(t.slot_of) - t.unevictable
        if exact and n > evictable:
            return []
        n = min(n, evictable)
        acc, counts = self._acc, t.acc
        if acc is None or counts is None or not n:
            return self._prepare_evict(t, n, keep, keep_order)
        by = counts.cause(for_keys, n)  # the evictions' cause (counted per tenant)
        if by == QUOTA:  # the policy's own pick might break the quotas: they choose
            shares = counts.shares(for_keys, n)  # the tenants the room is for
            return self._quota_evict(t, n, exact, keep, keep_order, acc, shares, for_keys)
        if self._blocked:  # (an eviction within the quotas found room)
            self._blocked.pop(tier, None)
        if by != MIXED:
            return self._prepare_evict(t, n, keep, keep_order, None, by)
        return self._evict_for_several(t, n, keep, keep_order, for_keys)

    def _evict_for_several(
        self,
        t: _Tier,
        n: int,
        keep: Collection[Key] | None,
        keep_order: Sequence[Key] | None,
        for_keys: Sequence[Key],
    ) -> list[tuple[Key, int]]:
        """:meth:`_prepare_evict` of room for several tenants' pages (``for_keys``): one pick
        by policy, the victims each tenant's share picked in turn would take, each then counted
        as caused by the tenant of the page it makes room for (:meth:`TierCounts.assign`)."""
        out = self._prepare_evict(t, n, keep, keep_order)
        if out and t.acc is not None:
            try:
                t.acc.assign(for_keys, n, [s for _, s in out])
            except BaseException:
                self._put_back(t, [k for k, _ in out])
                raise
        return out

    def _prepare_evict(
        self,
        t: _Tier,
        n: int,
        keep: Collection[Key] | None,
        keep_order: Sequence[Key] | None,
        allow: Callable[[Key], bool] | None = None,
        by: int | None = None,
    ) -> list[tuple[Key, int]]:
        """:meth:`prepare_evict` of up to ``n`` pages, by policy and ``keep``, of those
        ``allow`` allows (the tenants' quotas; None: any), for tenant ``by``'s pages."""
        if not keep or not n:
            return self._pick(t, n, None, None, allow, by)
        if keep_order and self._order(t, keep_order).held() == len(t.slot_of):
            # every page is kept (``keep_order`` lists ``keep``; counted in numpy): the
            # policy's scan for pages nobody keeps would walk them all and find none, so
            # straight to the order
            return self._pick(t, n, None, keep_order, allow, by)
        first = self._pick(t, n, keep, None, allow, by)  # pages nobody keeps first, then the rest
        if len(first) == n:
            return first
        try:
            return first + self._pick(t, n - len(first), None, keep_order, allow, by)
        except TierKVError:  # a policy bug: the first pick goes back too
            self._put_back(t, [k for k, _ in first])
            raise

    def _quota_evict(
        self,
        t: _Tier,
        n: int,
        exact: bool,
        keep: Collection[Key] | None,
        keep_order: Sequence[Key] | None,
        acc: Tenants,
        shares: list[tuple[int | None, int]],
        for_keys: Sequence[Key],
    ) -> list[tuple[Key, int]]:
        """:meth:`prepare_evict` within the tenants' quotas: passes of rule 1, then rule 2
        (:meth:`Tenants.room`), each taking pages nobody keeps first, for each tenant's share
        of the room (``shares``: :meth:`TierCounts.shares` of ``for_keys``; several when a
        batch loads or writes back pages of several tenants); all or nothing with ``exact``."""
        out: list[tuple[Key, int]] = []
        none: Mapping[int | None, int] = _NONE_TAKEN  # (victims are counted as they go MOVING)
        short: list[int | None] = []  # the tenants whose share found too few
        if not acc.over_limit(t.name):  # the policy's own pick first: most keep the quotas
            if len(shares) == 1:
                by = shares[0][0]
                out = self._prepare_evict(t, n, keep, keep_order, by=by)
            else:  # (several: each tenant's share by policy, kept only if no tenant goes
                by = None  # below its reservation at all)
                out = self._evict_for_several(t, n, keep, keep_order, for_keys)
            keys = [key for key, _ in out]
            if not acc.keeps_reserves(t.name, keys, by, counted=True):  # (MOVING: counted)
                self._put_back(t, keys)
                out = []
            elif len(out) == n:
                self._blocked.pop(t.name, None)
                return out
            elif len(shares) > 1:  # too few: the rules' passes share by share, from none
                self._put_back(t, keys)
                out = []
        for by, want in shares:
            kept = len(out) if len(shares) == 1 else 0  # (the policy's pick that kept them)

            def pick(k: int, allow: Callable[[Key], bool] | None, by: int | None = by) -> int:
                picked = self._prepare_evict(t, k, keep, keep_order, allow, by)
                out.extend(picked)
                return len(picked)

            if kept + _by_rules(acc, t.name, want - kept, none, by, pick) < want:
                short.append(by)
        if short:
            self._blocked[t.name] = short[0]
            acc.blocked(short[0])
            if exact and out:
                self._put_back(t, [key for key, _ in out])
                return []
        else:
            self._blocked.pop(t.name, None)
        return out

    def _pick(
        self,
        t: _Tier,
        n: int,
        keep: Collection[Key] | None,
        order: Sequence[Key] | None = None,
        allow: Callable[[Key], bool] | None = None,
        by: int | None = None,
    ) -> list[tuple[Key, int]]:
        """Up to ``n`` victims not in ``keep`` (any, when ``keep`` is None) and that ``allow``
        allows (the tenants' quotas), marked MOVING, counted as caused by tenant ``by``; with
        ``order``, the evictable pages latest in it go first."""
        if n <= 0:
            return []
        state, pins, key_of = t.state, t.pins, t.key_of
        only: list[int] | None = None
        if order and allow is None:  # the slots' places in the order, kept as pages come
            only = self._order(t, order).latest(n, state, pins, _READABLE)  # and go (numpy)
        elif order and allow is not None:  # the tenants' quotas allow some only: the latest
            slot_of = t.slot_of
            late: dict[int, None] = {}
            for k in reversed(order):
                s = slot_of.get(k)
                if s is not None and not pins[s] and state[s] == _READABLE and allow(k):
                    late[s] = None
                    if len(late) >= n:
                        break
            only = list(late)

        def can_evict_slot(s: int) -> bool:
            return not pins[s] and state[s] == _READABLE

        kept: Collection[Key] = keep or ()

        def can_evict_unkept(s: int) -> bool:
            return not pins[s] and state[s] == _READABLE and key_of[s] not in kept

        if allow is not None:
            plain = can_evict_slot if keep is None else can_evict_unkept

            def can_evict_slot(s: int) -> bool:
                return plain(s) and allow(key_of[s])

            can_evict_unkept = can_evict_slot

        if only is not None:  # the order chose them (evictable): no scan for them
            want = len(only)
            slots = t.policy.evict_chosen(only)
        else:
            want = n
            slots = t.policy.evict_slots(want, can_evict_slot if keep is None else can_evict_unkept)
        keys = list(map(key_of.__getitem__, slots))
        out = list(zip(keys, slots))
        states = t.policy.evicted_state_slots(slots, keys)
        if keep is None and allow is None:  # every candidate it may take was evictable: the
            self._check_victims(t, want, slots, keys)  # policy owes them all
        t.undo.update(zip(slots, states))
        set_states(state, slots, _MOVING)
        t.unevictable += len(out)
        t.moving += len(out)
        if t.acc is not None:  # MOVING pages are no tenant's any more (undone if put
            t.acc.evicted(keys, by, slots)  # back), each slot remembering the cause
        if only is not None and len(out) < n:  # the rest by policy
            out += self._pick(t, n - len(out), None, None, allow, by)
        return out

    def complete_evict(self, keys: Sequence[Key], tier: str, ok: bool = True) -> None:
        """Drop MOVING pages from ``tier`` (``ok``), or make them readable again.

        A page put back (not ``ok``) returns to the policy exactly where it was when it was
        chosen, with its counters: a rollback is not a use.

        Raises:
            UnknownPageError / PageStateError: a key is not MOVING in the tier.
        """
        t = self._tier(tier)
        if not ok:
            self._put_back(t, keys)
            return
        slots = self._state_slots(t, keys, _MOVING)
        undo = t.undo
        deque(map(t.slot_of.__delitem__, keys), 0)  # C-speed passes, no Python per page
        deque(map(t.key_of.__delitem__, slots), 0)
        deque(map(undo.__delitem__, slots), 0)
        t.free.extend(slots)
        if t.order is not None:
            t.order.freed(slots)
        self._forget(keys)
        if self._record and slots:
            self._events.append(PageEvent("evicted", tier, tuple(keys)))
        t.unevictable -= len(slots)
        t.moving -= len(slots)

    def _put_back(self, t: _Tier, keys: Sequence[Key]) -> None:
        """MOVING pages of ``keys`` made readable again, where the policy had them (their
        eviction undone, for the tenants' counts too)."""
        slots = self._state_slots(t, keys, _MOVING)
        undo = t.undo
        if t.acc is not None:
            t.acc.put_back(keys, slots)
        for s in slots:
            t.state[s] = _READABLE
        # in the order they were chosen (``undo`` keeps it), so that each lands where it was
        back = set(slots)
        vs = [s for s in undo if s in back] if len(slots) > 1 else list(slots)
        key_of = t.key_of
        if vs:
            t.policy.restore_slots(vs, [key_of[s] for s in vs], [undo.pop(s) for s in vs])
        t.unevictable -= len(slots)
        t.moving -= len(slots)

    def remove(self, keys: Sequence[Key], tier: str) -> None:
        """Drop readable, unpinned pages (for example a released sequence's private pages).

        Raises:
            UnknownPageError: a key is not in the tier.
            PageStateError: a page is pinned or not readable.
        """
        t = self._tier(tier)
        slots = self._state_slots(t, keys, _READABLE)
        for k, s in zip(keys, slots):
            if t.pins[s]:
                raise PageStateError(f"page {_show(k)} in tier {tier!r} is pinned ({t.pins[s]})")
        self._drop(t, keys, slots)
        if self._record and slots:
            self._events.append(PageEvent("removed", tier, tuple(keys)))

    def rekey(self, old: Sequence[Key], new: Sequence[Key], tier: str) -> None:
        """Rename pages in ``tier`` in place (same slot, state and pins), for example when a
        sequence's private block fills up and becomes a shareable content block.

        Raises:
            UnknownPageError: an old key is not in the tier.
            PageStateError: a new key is already in the tier, a key repeats, or the lists differ
                in length.
        """
        t = self._tier(tier)
        if len(old) != len(new) or len(set(new)) != len(new) or len(set(old)) != len(old):
            raise PageStateError("rekey needs two lists of equal length and distinct keys")
        slots = self._slots(t, old)
        for k in new:
            if k in t.slot_of:
                raise PageStateError(f"page {_show(k)} is already in tier {tier!r}")
        self.sums.rename(old, new)
        policy = t.policy
        for k_old, k_new, s in zip(old, new, slots):
            del t.slot_of[k_old]
            t.slot_of[k_new] = s
            t.key_of[s] = k_new
            if t.order is not None:
                t.order.placed((s,), (k_new,))
            if t.state[s] != _MOVING:  # MOVING pages already left the policy
                policy.remove_slots((s,), (k_old,))  # to the recent end, as a remove and an
                policy.insert_slots((s,), (k_new,), None)  # insert would

    def candidates(self, tier: str, n: int) -> list[Key]:
        """The pages :meth:`prepare_evict` would choose next in ``tier`` (at most ``n``, best
        victim first), without changing anything. Cheap for LRU, LFU and ARC; kvaware and
        S3-FIFO evict on a copy of their state (O(pages)): for operators, not every step."""
        t = self._tier(tier)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError(f"candidates needs a count >= 0, got {n!r}")
        slot_of, state, pins = t.slot_of, t.state, t.pins
        n = min(n, len(slot_of) - t.unevictable)
        if n <= 0:
            return []

        def can_evict_slot(s: int) -> bool:
            return not pins[s] and state[s] == _READABLE

        key_of = t.key_of
        return [key_of[s] for s in t.policy.candidate_slots(n, can_evict_slot)]

    def take_events(self) -> list[PageEvent]:
        """Return and clear the stored / evicted / removed events since the last call."""
        ev, self._events = self._events, []
        return ev

    # -- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Assert the table's invariants (for tests and debugging). Raises AssertionError."""
        for t in self._tiers.values():
            used = list(t.slot_of.values())
            assert len(used) <= t.capacity, f"{t.name} over capacity"
            every = sorted(used + t.free.tolist())
            assert every == list(range(t.capacity)), f"{t.name} slot accounting"
            assert all(t.pins[s] == 0 for s in t.free), f"{t.name} pinned free slot"
            assert all(t.pins[s] >= 0 for s in used), f"{t.name} negative pins"
            unevictable = sum(1 for s in used if t.pins[s] or t.state[s] != _READABLE)
            assert unevictable == t.unevictable, f"{t.name} unevictable count"
            in_policy = sum(1 for s in used if t.state[s] != _MOVING)
            assert len(t.policy) == in_policy, f"{t.name} policy holds {len(t.policy)}"
            assert all(t.key_of[s] == k for k, s in t.slot_of.items()), f"{t.name} key_of"
            assert all(s not in t.key_of for s in t.free), f"{t.name} key_of of a free slot"
            assert len(used) - in_policy == t.moving, f"{t.name} moving count"
            moving = {s for s in used if t.state[s] == _MOVING}
            assert set(t.undo) == moving, f"{t.name} undo records"
            if t.order is not None:
                t.order.check(t.key_of)
        held = [t.slot_of for t in self._tiers.values()]
        for k in self.sums.known():
            assert any(k in h for h in held), f"checksum of {_show(k)}, in no tier"

    # -- helpers -------------------------------------------------------------------------
    def _tier(self, name: str) -> _Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise UnknownPageError(f"no tier named {name!r}; tiers: {list(self._tiers)}") from None

    @staticmethod
    def _slot(t: _Tier, key: Key) -> int:
        s = t.slot_of.get(key)
        if s is None:
            raise UnknownPageError(f"page {_show(key)} is not in tier {t.name!r}")
        return s

    @staticmethod
    def _slots(t: _Tier, keys: Sequence[Key]) -> list[int]:
        slot_of = t.slot_of
        try:
            if len(keys) > 1:  # one C-level pass
                return list(itemgetter(*keys)(slot_of))
            return [slot_of[k] for k in keys]
        except KeyError as exc:
            raise UnknownPageError(f"page {_show(exc.args[0])} is not in tier {t.name!r}") from None

    @staticmethod
    def _raise_state(t: _Tier, keys: Sequence[Key], slots: list[int], want: int) -> None:
        for k, s in zip(keys, slots):
            if t.state[s] != want:
                raise PageStateError(
                    f"page {_show(k)} in tier {t.name!r} is {PageState(t.state[s]).name}, "
                    f"expected {PageState(want).name}"
                )

    def _state_slots(self, t: _Tier, keys: Sequence[Key], want: int) -> list[int]:
        slots = self._slots(t, keys)
        if len(set(slots)) != len(slots):
            raise PageStateError(f"a page is named twice in {[_show(k) for k in keys]}")
        if _count(t.state, slots, want) != len(slots):
            self._raise_state(t, keys, slots, want)
        return slots

    def _drop(self, t: _Tier, keys: Sequence[Key], slots: list[int]) -> None:
        slot_of, key_of = t.slot_of, t.key_of
        for k, s in zip(keys, slots):
            del slot_of[k]
            del key_of[s]
        t.policy.remove_slots(slots, keys)
        t.free.extend(slots)
        if t.acc is not None:
            t.acc.left(keys)
        if t.order is not None:
            t.order.freed(slots)
        self._forget(keys)

    def _forget(self, keys: Iterable[Key]) -> None:
        """Drop the checksums of the pages of ``keys`` that no tier holds any more."""
        sums = self.sums
        if not len(sums):
            return
        gone = sums.known_of(keys)
        for t in self._tiers.values():  # one C-speed pass per tier, no generator per key
            if gone:
                held = t.slot_of
                gone = [k for k in gone if k not in held]
        if gone:
            sums.pop(gone)


def _count(values: bytearray, slots: Sequence[int], want: int) -> int:
    """How many of ``values[s] for s in slots`` equal ``want`` (one C-level pass)."""
    if len(slots) > 1:
        return int(itemgetter(*slots)(values).count(want))
    return sum(1 for s in slots if values[s] == want)


def _show(key: Key) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
