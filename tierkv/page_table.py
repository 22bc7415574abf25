"""The page table: which tier holds each page, in what state, with how many pins.

The contract follows the two-phase moves of vLLM's offloading manager::

    lookup(keys, tier)            -> length of the longest resident (readable) prefix
    prepare_load(keys, tier)      -> slots; pins every page (pinned pages are never evicted)
    complete_load(keys, tier)     unpins, records the use
    prepare_store(keys, tier)     -> StoreAllocation (evicting by policy), or None when there is
                                     no room because everything else is pinned / moving / writing
    complete_store(keys, tier, ok) commits (WRITING -> READABLE) or rolls back
    prepare_evict(tier, n)        -> victims, marked MOVING (for a write-back to a lower tier)
    complete_evict(keys, tier, ok) drops them (or puts them back)
    touch(keys, tier) / remove(keys, tier) / take_events()

A page's life in one tier::

    prepare_store        complete_store(ok)         prepare_evict        complete_evict(ok)
   ───────────> WRITING ───────────────────> READABLE ───────────> MOVING ──────────────> gone
                   │ complete_store(not ok)    │  ▲  prepare_load/complete_load: pins    ▲
                   └──────────> gone           │  └── complete_evict(not ok) ───────────┘
                                               └── evicted by policy (unpinned only) ──> gone

Misuse (an unknown key, a double complete, unpinning an unpinned page, a page in the wrong state)
raises a :class:`~tierkv.errors.PageTableError` subclass *before* anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from tierkv.errors import PageStateError, PinError, TierKVError, UnknownPageError
from tierkv.policies import DEFAULT_POLICY, NO_HINT, EvictionPolicy, Key, PageHint, make_policy


class PageState(IntEnum):
    """State of a page in one tier."""

    WRITING = 0
    READABLE = 1
    MOVING = 2


@dataclass(slots=True)
class _Entry:
    state: int
    pins: int
    slot: int


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
class PageEvent:
    """An observable change: ``kind`` is ``"stored"``, ``"evicted"`` or ``"removed"``."""

    kind: str
    tier: str
    keys: tuple[Key, ...]


@dataclass(slots=True)
class _Tier:
    name: str
    capacity: int
    policy: EvictionPolicy
    entries: dict[Key, _Entry] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    unevictable: int = 0  # entries that are pinned, WRITING or MOVING


class PageTable:
    """Pages across named tiers, each with a capacity in pages and its own eviction policy.

    Args:
        tiers: tier name -> capacity in pages, highest tier first (e.g.
            ``{"device": 512, "host": 8192}``).
        policy: a policy name for every tier, or a mapping tier name -> policy name.
        record_events: keep stored/evicted events for :meth:`take_events`.

    Raises:
        ValueError: no tiers, or a capacity below 1, or an unknown policy.
    """

    def __init__(
        self,
        tiers: Mapping[str, int],
        policy: str | Mapping[str, str] = DEFAULT_POLICY,
        *,
        record_events: bool = True,
    ) -> None:
        if not tiers:
            raise ValueError("a page table needs at least one tier")
        self._tiers: dict[str, _Tier] = {}
        for name, cap in tiers.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"tier {name!r}: capacity must be a positive int, got {cap!r}")
            pol = policy if isinstance(policy, str) else policy.get(name, DEFAULT_POLICY)
            self._tiers[name] = _Tier(
                name, cap, make_policy(pol), free=list(range(cap - 1, -1, -1))
            )
        self._record = record_events
        self._events: list[PageEvent] = []

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
        return len(self._tier(tier).entries)

    def evictable(self, tier: str) -> int:
        """Pages of ``tier`` that the policy may evict now (readable and unpinned)."""
        t = self._tier(tier)
        return len(t.entries) - t.unevictable

    def policy(self, tier: str) -> EvictionPolicy:
        """The eviction policy of ``tier``."""
        return self._tier(tier).policy

    def tiers_of(self, key: Key) -> list[str]:
        """Names of the tiers that hold ``key`` (in any state), highest first."""
        return [t.name for t in self._tiers.values() if key in t.entries]

    def state(self, key: Key, tier: str) -> PageState:
        """State of ``key`` in ``tier``. Raises UnknownPageError."""
        return PageState(self._entry(self._tier(tier), key).state)

    def pins(self, key: Key, tier: str) -> int:
        """Pin count of ``key`` in ``tier``. Raises UnknownPageError."""
        return self._entry(self._tier(tier), key).pins

    def slot(self, key: Key, tier: str) -> int:
        """Slot of ``key`` in ``tier``. Raises UnknownPageError."""
        return self._entry(self._tier(tier), key).slot

    def keys(self, tier: str) -> list[Key]:
        """Every key held by ``tier``."""
        return list(self._tier(tier).entries)

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key], tier: str | None = None) -> int:
        """Length of the longest prefix of ``keys`` readable in ``tier`` (any tier if None)."""
        readable = PageState.READABLE
        if tier is not None:
            entries = self._tier(tier).entries
            n = 0
            for k in keys:
                e = entries.get(k)
                if e is None or e.state != readable:
                    break
                n += 1
            return n
        tiers = [t.entries for t in self._tiers.values()]
        n = 0
        for k in keys:
            for entries in tiers:
                e = entries.get(k)
                if e is not None and e.state == readable:
                    break
            else:
                break
            n += 1
        return n

    def present(self, keys: Iterable[Key], tier: str) -> list[Key]:
        """The keys (in order) that ``tier`` holds in any state."""
        entries = self._tier(tier).entries
        return [k for k in keys if k in entries]

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
        entries = t.entries
        readable = PageState.READABLE
        batch: list[_Entry] = []
        for k in keys:
            e = entries.get(k)
            if e is None:
                raise UnknownPageError(f"page {_show(k)} is not in tier {tier!r}")
            if e.state != readable:
                raise PageStateError(
                    f"page {_show(k)} in tier {tier!r} is {PageState(e.state).name}, not READABLE"
                )
            batch.append(e)
        newly = 0
        for e in batch:
            if e.pins == 0:
                newly += 1
            e.pins += 1
        t.unevictable += newly
        return [e.slot for e in batch]

    def complete_load(self, keys: Sequence[Key], tier: str) -> None:
        """Unpin pages pinned by :meth:`prepare_load` and record their use.

        Raises:
            UnknownPageError: a key is not in the tier.
            PinError: a page is not pinned (as often as ``keys`` names it).
        """
        t = self._tier(tier)
        batch = self._pinned_batch(t, keys)
        freed = 0
        for e in batch:
            e.pins -= 1
            if e.pins == 0 and e.state == PageState.READABLE:
                freed += 1
        t.unevictable -= freed
        t.policy.touch_many(keys)

    def touch(self, keys: Iterable[Key], tier: str) -> None:
        """Record a use of resident pages. Raises UnknownPageError (nothing is touched)."""
        t = self._tier(tier)
        keys = list(keys)
        entries = t.entries
        for k in keys:
            if k not in entries:
                raise UnknownPageError(f"page {_show(k)} is not in tier {tier!r}")
        t.policy.touch_many(keys)

    # -- stores --------------------------------------------------------------------------
    def prepare_store(
        self,
        keys: Sequence[Key],
        tier: str,
        hints: Sequence[PageHint] | None = None,
    ) -> StoreAllocation | None:
        """Reserve slots for the pages of ``keys`` not yet in ``tier``, evicting by policy.

        Pages already present are reported in ``present`` (call :meth:`touch` to record a
        use); they, and the new pages, are never chosen as victims. New pages are WRITING until
        :meth:`complete_store`.

        Returns:
            The allocation, or ``None`` when the tier cannot make room because too many pages
            are pinned, moving or being written (nothing changed then).
        """
        t = self._tier(tier)
        if hints is not None and len(hints) != len(keys):
            raise ValueError(f"{len(hints)} hints for {len(keys)} keys")
        entries = t.entries
        present: list[Key] = []
        new: list[Key] = []
        new_hints: list[PageHint] = []
        seen: set[Key] = set()
        protect_evictable = 0
        readable = PageState.READABLE
        for i, k in enumerate(keys):
            if k in seen:
                continue
            seen.add(k)
            e = entries.get(k)
            if e is None:
                new.append(k)
                new_hints.append(hints[i] if hints is not None else NO_HINT)
            else:
                present.append(k)
                if e.pins == 0 and e.state == readable:
                    protect_evictable += 1
        rejected: list[Key] = []
        need = len(new) - len(t.free)
        if need > 0:
            admit = t.policy.admit
            kept = [(k, h) for k, h in zip(new, new_hints) if admit(k, h)]
            if len(kept) != len(new):
                kept_keys = {k for k, _ in kept}
                rejected = [k for k in new if k not in kept_keys]
                new = [k for k, _ in kept]
                new_hints = [h for _, h in kept]
                need = len(new) - len(t.free)
            evictable = len(entries) - t.unevictable - protect_evictable
            if need > evictable:
                return None
        evicted: list[Key] = []
        if need > 0:
            protect = seen

            def can_evict(k: Key) -> bool:
                e = entries[k]
                return e.pins == 0 and e.state == readable and k not in protect

            evict = t.policy.evict
            free = t.free
            for _ in range(need):
                victim = evict(can_evict)
                if victim is None:  # the policy disagrees with our count: a policy bug
                    raise TierKVError(f"policy {t.policy.name!r} found no victim in {tier!r}")
                free.append(entries.pop(victim).slot)
                evicted.append(victim)
            if self._record:
                self._events.append(PageEvent("evicted", tier, tuple(evicted)))
        free = t.free
        slots: list[int] = []
        insert = t.policy.insert
        writing = PageState.WRITING
        for k, h in zip(new, new_hints):
            s = free.pop()
            entries[k] = _Entry(writing, 0, s)
            insert(k, h)
            slots.append(s)
        t.unevictable += len(new)
        return StoreAllocation(tier, new, slots, evicted, present, rejected)

    def complete_store(self, keys: Sequence[Key], tier: str, ok: bool = True) -> None:
        """Commit (``ok``) or roll back pages reserved by :meth:`prepare_store`.

        Raises:
            UnknownPageError: a key is not in the tier.
            PageStateError: a page is not WRITING (for example a double complete).
        """
        t = self._tier(tier)
        batch = self._state_batch(t, keys, PageState.WRITING)
        if ok:
            for e in batch:
                e.state = PageState.READABLE
            t.unevictable -= len(batch)
            if self._record and batch:
                self._events.append(PageEvent("stored", tier, tuple(keys)))
        else:
            self._drop(t, keys, batch)
            t.unevictable -= len(batch)

    # -- moves down ----------------------------------------------------------------------
    def prepare_evict(self, tier: str, n: int) -> list[tuple[Key, int]]:
        """Choose up to ``n`` victims by policy and mark them MOVING; returns (key, slot) pairs.

        Use it to write pages back to a lower tier before they leave this one.
        """
        t = self._tier(tier)
        entries = t.entries
        readable = PageState.READABLE

        def can_evict(k: Key) -> bool:
            e = entries[k]
            return e.pins == 0 and e.state == readable

        out: list[tuple[Key, int]] = []
        for _ in range(min(n, len(entries) - t.unevictable)):
            victim = t.policy.evict(can_evict)
            if victim is None:
                break
            e = entries[victim]
            e.state = PageState.MOVING
            out.append((victim, e.slot))
        t.unevictable += len(out)
        return out

    def complete_evict(self, keys: Sequence[Key], tier: str, ok: bool = True) -> None:
        """Drop MOVING pages from ``tier`` (``ok``), or make them readable again.

        Raises:
            UnknownPageError / PageStateError: a key is not MOVING in the tier.
        """
        t = self._tier(tier)
        batch = self._state_batch(t, keys, PageState.MOVING)
        if ok:
            for k, e in zip(keys, batch):
                del t.entries[k]
                t.free.append(e.slot)
            if self._record and batch:
                self._events.append(PageEvent("evicted", tier, tuple(keys)))
        else:
            for k, e in zip(keys, batch):
                e.state = PageState.READABLE
                t.policy.insert(k)
        t.unevictable -= len(batch)

    def remove(self, keys: Sequence[Key], tier: str) -> None:
        """Drop readable, unpinned pages (for example a released sequence's private pages).

        Raises:
            UnknownPageError: a key is not in the tier.
            PageStateError: a page is pinned or not readable.
        """
        t = self._tier(tier)
        batch = self._state_batch(t, keys, PageState.READABLE)
        for k, e in zip(keys, batch):
            if e.pins:
                raise PageStateError(f"page {_show(k)} in tier {tier!r} is pinned ({e.pins})")
        self._drop(t, keys, batch)
        if self._record and batch:
            self._events.append(PageEvent("removed", tier, tuple(keys)))

    def take_events(self) -> list[PageEvent]:
        """Return and clear the stored / evicted / removed events since the last call."""
        ev, self._events = self._events, []
        return ev

    # -- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Assert the table's invariants (for tests and debugging). Raises AssertionError."""
        for t in self._tiers.values():
            assert len(t.entries) <= t.capacity, f"{t.name} over capacity"
            assert len(t.entries) + len(t.free) == t.capacity, f"{t.name} slot leak"
            slots = [e.slot for e in t.entries.values()] + t.free
            assert sorted(slots) == list(range(t.capacity)), f"{t.name} slot accounting"
            unevictable = sum(
                1 for e in t.entries.values() if e.pins or e.state != PageState.READABLE
            )
            assert unevictable == t.unevictable, f"{t.name} unevictable count"
            assert all(e.pins >= 0 for e in t.entries.values()), f"{t.name} negative pins"
            in_policy = sum(1 for e in t.entries.values() if e.state != PageState.MOVING)
            assert len(t.policy) == in_policy, f"{t.name} policy holds {len(t.policy)}"

    # -- helpers -------------------------------------------------------------------------
    def _tier(self, name: str) -> _Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise UnknownPageError(f"no tier named {name!r}; tiers: {list(self._tiers)}") from None

    @staticmethod
    def _entry(t: _Tier, key: Key) -> _Entry:
        e = t.entries.get(key)
        if e is None:
            raise UnknownPageError(f"page {_show(key)} is not in tier {t.name!r}")
        return e

    def _pinned_batch(self, t: _Tier, keys: Sequence[Key]) -> list[_Entry]:
        batch: list[_Entry] = []
        need: dict[Key, int] = {}
        for k in keys:
            e = self._entry(t, k)
            c = need.get(k, 0) + 1
            if e.pins < c:
                raise PinError(f"page {_show(k)} in tier {t.name!r} is not pinned")
            need[k] = c
            batch.append(e)
        return batch

    def _state_batch(self, t: _Tier, keys: Sequence[Key], state: PageState) -> list[_Entry]:
        batch: list[_Entry] = []
        seen: set[Key] = set()
        for k in keys:
            e = self._entry(t, k)
            if k in seen:
                raise PageStateError(f"page {_show(k)} named twice")
            seen.add(k)
            if e.state != state:
                raise PageStateError(
                    f"page {_show(k)} in tier {t.name!r} is {PageState(e.state).name}, "
                    f"expected {state.name}"
                )
            batch.append(e)
        return batch

    @staticmethod
    def _drop(t: _Tier, keys: Sequence[Key], batch: list[_Entry]) -> None:
        for k, e in zip(keys, batch):
            del t.entries[k]
            t.free.append(e.slot)
            t.policy.remove(k)


def _show(key: Key) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
