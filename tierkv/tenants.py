"""Tenants and their quotas: who is charged for each page, and which pages an eviction may take.

::

    KVStore(spec, ..., tenants={"alice": tierkv.Quota(device_reserve=64 << 20,
                                                      host_reserve=1 << 30, host_limit=4 << 30),
                                "bob": tierkv.Quota(host_limit=512 << 20)})
    await store.add_sequence("r1", prompt, tenant="alice", salt="alice")

A page is **charged** to the tenant whose sequence made it (computed it, or imported it from
the disk or a remote tier for it); a prefix page that sequences of several tenants share stays
charged to the first (its maker). Pages of sequences without a tenant are charged to nobody:
no quota protects them and none counts them. The charge follows the page through every tier of
the page table (device, host, cold) and through its rename from private to content key.

Per tier, a tenant has a **reservation** and a **limit** (bytes, converted to pages of that
tier: the reservation rounded up, the limit down). Evictions, wherever they happen (a lease
making room on the device, the host making room for a write-back or an import, the cold pool
making room for a compression), follow two rules, in this order:

1. pages of tenants **over their limit** go first (so a tenant that floods evicts its own pages
   before anyone else's);
2. no eviction takes a page of a tenant that would leave it **below its reservation**.

An eviction that cannot free its room under rule 2 takes nothing and the admission that asked
waits for room (bounded by the store's timeout) or fails with
:class:`~tierkv.errors.QuotaExceededError` (a ``TierFullError``). The limit is work-conserving:
a tenant may use free room above it, and its pages above the limit are the first to go as soon
as anyone needs room.

:class:`Tenants` is the one owner of this accounting: the page table tells it of pages arriving
and leaving (through each tier's :class:`~tierkv.tenant_counts.TierCounts`: one call per
batch) and asks it which pages an eviction may take
(:meth:`Tenants.room`); nothing else reads or writes its counts. Each call is O(pages it names)
with the per-page work in C (``map``, ``list.count``), and a store without tenants has none of
it (the page table's hook is ``None``).

This file stays whole (over 400 lines): the charges, the counts and the two rules read and
change the same per-tenant counts, and each hook must see the others' bookkeeping.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import repeat
from numbers import Integral
from typing import Any, cast

from tierkv.arguments import checked_init
from tierkv.errors import InvalidTypeError, QuotaConfigError, UnknownTenantError
from tierkv.tenant_counts import NO_LIMIT as _NO_LIMIT
from tierkv.tenant_counts import TierCounts
from tierkv.tenant_names import case_hint, check_distinct, check_tenant

__all__ = ["TIERS", "Quota", "Tenants"]

TIERS = ("device", "host", "cold")
"""The tiers a quota names (the page table's; the disk and remote tiers have none)."""

Key = Hashable
"""A page key (bytes in a store; any hashable in a bare page table)."""
Allow = Callable[[Key], bool]


@checked_init
@dataclass(frozen=True)
class Quota:
    """One tenant's share of the tiers, in bytes: per tier a reservation (pages no eviction
    takes from it) and a limit (above it, its pages are evicted first); ``None``: no limit.

    Raises InvalidTypeError (not an int, or a bool), QuotaConfigError (negative, or a
    reservation above the limit).
    """

    device_reserve: int = 0
    device_limit: int | None = None
    host_reserve: int = 0
    host_limit: int | None = None
    cold_reserve: int = 0
    cold_limit: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name.endswith("_limit"):
                continue
            if isinstance(v, bool) or not isinstance(v, Integral):
                raise _QuotaTypeError(f"Quota.{f.name} must be an int of bytes, got {v!r}")
            if not isinstance(v, int):  # numpy's integers, as the tiers' budgets take them
                v = operator.index(v)
                object.__setattr__(self, f.name, v)
            if v < 0:
                raise QuotaConfigError(f"Quota.{f.name} must be >= 0, got {v}")
        for tier in TIERS:
            r, lim = self.reserve(tier), self.limit(tier)
            if lim is not None and r > lim:
                raise QuotaConfigError(f"Quota: {tier} reservation {r} B over its limit {lim} B")

    def reserve(self, tier: str) -> int:
        """The reservation in ``tier`` (bytes)."""
        return int(getattr(self, f"{tier}_reserve"))

    def limit(self, tier: str) -> int | None:
        """The limit in ``tier`` (bytes), or None."""
        v = getattr(self, f"{tier}_limit")
        return None if v is None else int(v)


class _QuotaTypeError(QuotaConfigError, InvalidTypeError):
    """A quota field of the wrong type."""


@dataclass
class TenantCounters:
    """One tenant's totals (``stats()["tenants"][name]``)."""

    sequences: int = 0
    prompt_tokens: int = 0
    prefix_tokens_reused: int = 0
    refusals: int = 0


_PRUNE_MIN = 1 << 16  # charges kept before the first prune


def tenant_index(tenants: Tenants | None, name: object) -> int | None:
    """The index of tenant ``name`` in ``tenants`` (a store's; None for a store without
    tenants), None for None. Raises TenantError for a bad name, UnknownTenantError for one
    not configured (any name, for a store without tenants)."""
    if name is None:
        return None
    if tenants is None:
        check_tenant(name)
        raise UnknownTenantError(f"unknown tenant {name!r}: this store has no tenants")
    return tenants.tenant(name)


class Tenants:
    """The tenants of one store, their quotas in pages, their charges and counts.

    Args:
        quotas: tenant name -> :class:`Quota` (names checked by
            :func:`tierkv.tenant_names.check_tenant`).
        slot_bytes: tier -> bytes of one page slot there, for each tier the store has.
        capacity: tier -> pages the tier holds.

    Raises InvalidTypeError / TenantError (a bad name or a quota that is not a Quota),
    QuotaConfigError (a quota for a tier the store lacks, reservations over a tier's capacity).
    """

    def __init__(
        self,
        quotas: Mapping[str, Quota],
        slot_bytes: Mapping[str, int],
        capacity: Mapping[str, int],
    ) -> None:
        if not isinstance(quotas, Mapping):
            raise _QuotaTypeError(f"tenants must be a dict of name -> Quota, got {quotas!r}")
        names = [check_tenant(n) for n in quotas]
        check_distinct(names)
        for n in names:
            if not isinstance(quotas[n], Quota):
                raise _QuotaTypeError(f"tenant {n!r}: expected a tierkv.Quota, got {quotas[n]!r}")
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.slot_bytes = dict(slot_bytes)
        self._reserve: dict[str, list[int]] = {}
        self._limit: dict[str, list[int]] = {}
        for tier in TIERS:
            if tier not in slot_bytes:
                for n in names:
                    if quotas[n].reserve(tier) or quotas[n].limit(tier) is not None:
                        raise QuotaConfigError(f"tenant {n!r}: a {tier} quota, no {tier} tier")
                continue
            size = slot_bytes[tier]
            self._reserve[tier] = [-(-quotas[n].reserve(tier) // size) for n in names]
            self._limit[tier] = [  # (a limit the tier cannot reach is none: nothing to check)
                _NO_LIMIT
                if (lim := quotas[n].limit(tier)) is None or lim // size >= capacity[tier]
                else lim // size
                for n in names
            ]
            total = sum(self._reserve[tier])
            if total > capacity[tier]:
                raise QuotaConfigError(
                    f"{tier} tier: reservations add up to {total} pages of {size} B, the tier "
                    f"holds {capacity[tier]}"
                )
        self._of: dict[Key, int] = {}  # page key -> the tenant charged for it
        self._prune_at = _PRUNE_MIN
        self._held: Callable[[list[Any]], Iterable[Key]] = lambda keys: keys  # (see bind)
        self._caused = [0] * len(names)
        # per tier, the pages per tenant (held, evicted), moved by the page table's hooks
        self._tiers = {
            t: TierCounts(self._of, self._caused, self._reserve[t], self._limit[t])
            for t in self._reserve
        }
        self.counters = [TenantCounters() for _ in names]
        self.unattributed_refusals = 0  # refusals of room for pages no tenant is charged for
        self._guards = {  # (tenant, reservation) of those with one in the tier
            t: [(i, x) for i, x in enumerate(r) if x] for t, r in self._reserve.items()
        }
        #: the tiers whose evictions must ask :meth:`room` (:meth:`active`)
        self.active_tiers = frozenset(t for t, c in self._tiers.items() if c.active)

    # -- entry -----------------------------------------------------------------------------
    def tenant(self, name: object) -> int | None:
        """The index of tenant ``name`` (None for None). Raises TenantError for a bad name,
        UnknownTenantError for one the store was not configured with."""
        if name is None:
            return None
        i = self.index.get(name) if isinstance(name, str) else None  # (configured: checked)
        if i is None:
            check_tenant(name)
            raise UnknownTenantError(
                f"unknown tenant {name!r} (configured: {self.names}){case_hint(name, self.names)}"
            )
        return i

    # -- charges ---------------------------------------------------------------------------
    def bind(self, held: Callable[[list[Any]], Iterable[Key]]) -> None:
        """``held(keys)``: the keys some tier holds (the page table's), to prune the charges
        of pages that left every tier."""
        self._held = held

    def charge(
        self, keys: Sequence[Key], tenant: int | None, *, fresh: bool = False, new: bool = False
    ) -> None:
        """Charge ``tenant`` for the pages of ``keys`` that nobody is charged for yet (the
        first maker pays). Call before the pages are stored in any tier. ``fresh``: the
        pages may have been held before (imports): a charge of one no tier holds now is
        stale and goes to ``tenant``. ``new``: pages no other tenant can have made (a
        sequence's new private pages): charged in one C-level update."""
        if tenant is None:
            return
        of = self._of
        if new:
            if len(keys) == 1:  # (an append's one page: no dict)
                of[keys[0]] = tenant
            else:
                of.update(dict.fromkeys(keys, tenant))
        elif fresh:
            held = set(self._held([k for k in keys if k in of]))
            of.update(dict.fromkeys((k for k in keys if k not in held), tenant))
        else:
            of.update(dict.fromkeys((k for k in keys if k not in of), tenant))
        if len(of) > self._prune_at:
            self.prune()

    def prune(self) -> None:
        """Forget the charges of pages no tier holds (released private pages, pages evicted
        from every tier): run when the charges double, so O(1) per page amortized, and no
        eviction pays for it. A stale charge in between is harmless: counts move only with
        pages that tiers hold, a rename overwrites it, an import replaces it (``fresh``)."""
        of = self._of
        keep = set(self._held(list(of)))
        kept = {k: i for k, i in of.items() if k in keep}
        of.clear()  # (in place: each tier's counts read this dict)
        of.update(kept)
        self._prune_at = max(_PRUNE_MIN, 2 * len(of))

    def charged(self, key: Key) -> str | None:
        """The tenant charged for ``key``, or None."""
        i = self._of.get(key)
        return None if i is None else self.names[i]

    def rename(self, old: Sequence[Key], new: Sequence[Key]) -> None:
        """Pages were renamed (a listener of :class:`~tierkv.ownership.Ownership`): their
        charges follow."""
        of = self._of
        got = list(map(of.pop, old, repeat(None)))  # (C-level passes)
        if None in got:
            of.update((n, i) for n, i in zip(new, got) if i is not None)
        else:
            of.update(zip(new, cast("list[int]", got)))

    # -- the page table's hooks --------------------------------------------------------------
    def counts(self, tier: str) -> TierCounts | None:
        """The counts of ``tier`` (None: no quota names it), which the page table holding
        the tier tells of pages arriving and leaving (:class:`TierCounts`' hooks)."""
        return self._tiers.get(tier)

    def _pages(self, tier: str) -> list[int]:
        """Pages per tenant in ``tier`` (not counting MOVING)."""
        return self._tiers[tier].pages()

    def caused(self, by: int | None, n: int) -> None:
        """``n`` evictions were made for tenant ``by``'s pages (None: nobody's)."""
        if by is not None:
            self._caused[by] += n

    def blocked(self, by: int | None) -> None:
        """An eviction for tenant ``by``'s pages found too few pages within the quotas: a
        refusal (the admission waits for room, or fails with QuotaExceededError)."""
        if by is None:
            self.unattributed_refusals += 1
        else:
            self.counters[by].refusals += 1

    def active(self, tier: str) -> bool:
        """Whether evictions from ``tier`` must ask :meth:`room`."""
        return tier in self.active_tiers

    def room(
        self,
        tier: str,
        n: int,
        over: bool,
        taken: Mapping[int | None, int],
        by: int | None = None,
    ) -> tuple[int, Allow | None] | None:
        """What an eviction that still needs ``n`` victims from ``tier`` may ask for next:
        ``(count, allow)``, ``allow(key)`` saying which pages (None: any), or None when this
        mode has nothing more. ``over``: rule 1 (pages of tenants over their limit, at most as
        many as each is over); else rule 2 (pages of nobody's, of tenants without a
        reservation, or of a tenant with at least ``count`` pages above its reservation).
        ``taken``: victims already chosen but not yet counted, per tenant; ``by``: the tenant
        the room is for, whose own pages rule 2 lets go (its new pages replace them). The
        caller asks again for the rest until a pass finds none."""
        used = self._pages(tier)
        of = self._of
        if over:
            lim = self._limit[tier]
            excess = [used[i] - taken.get(i, 0) - lim[i] for i in range(len(used))]
            pick = frozenset(i for i, e in enumerate(excess) if e > 0)
            if not pick:
                return None
            k = min(n, min(excess[i] for i in pick))
            return k, lambda key: of.get(key) in pick
        res = self._reserve[tier]
        spare = [
            used[i] - taken.get(i, 0) - res[i] if res[i] and i != by else _NO_LIMIT
            for i in range(len(used))
        ]
        if min(spare, default=_NO_LIMIT) >= n:
            return n, None
        low = frozenset(i for i, s in enumerate(spare) if s <= 0)
        k = min(n, min((s for s in spare if s > 0), default=n))
        return k, lambda key: of.get(key) not in low

    def over_limit(self, tier: str) -> bool:
        """Whether a tenant is over its limit in ``tier`` (rule 1 then picks the victims)."""
        c = self._tiers.get(tier)
        return c is not None and c.over_limit()

    def keeps_reserves(self, tier: str, keys: Sequence[Key], by: int | None, counted: bool) -> bool:
        """Whether evicting the pages of ``keys`` from ``tier`` leaves every tenant with
        victims among them (but ``by``, the tenant the room is for) at or above its
        reservation; ``counted``: the victims are out of the counts already (MOVING)."""
        guards = self._guards.get(tier)
        if not guards or not keys:
            return True
        used = self._pages(tier)
        ids = list(map(self._of.get, keys))
        for i, r in guards:  # the tenants with a reservation here: a C-level count each
            if i != by and (n := ids.count(i)) and (used[i] if counted else used[i] - n) < r:
                return False
        return True

    def parts(self, tier: str, keys: Sequence[Key]) -> list[list[Key]]:
        """``keys`` split by the tenant charged for each, in the order their room should be
        asked for in ``tier``: the tenant furthest below its reservation there first, pages
        of nobody's last (one part when they are one tenant's, as most batches are). A batch
        of several tenants' new pages asks room for each part on its own: the evictions each
        makes are that tenant's (rule 2 lets only its own pages go), and a refusal names it."""
        ids = list(map(self._of.get, keys))
        if not ids or ids.count(ids[0]) == len(ids):
            return [list(keys)]
        of: dict[int | None, list[Key]] = {}
        for k, i in zip(keys, ids):
            of.setdefault(i, []).append(k)
        used = self._pages(tier) if tier in self._tiers else None
        res = self._reserve.get(tier)

        def owed(i: int | None) -> int:
            if i is None:
                return -_NO_LIMIT
            return 0 if res is None or used is None else res[i] - used[i]

        return [of[i] for i in sorted(of, key=owed, reverse=True)]

    def tally(self, keys: Sequence[Key]) -> Counter[int | None]:
        """Victims per tenant (for :meth:`room`'s ``taken``)."""
        return Counter(map(self._of.get, keys))

    # -- figures ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tenant: sequences, prompt tokens, reused tokens, refusals, and per tier the
        pages and bytes it is charged for, the evictions it suffered; evictions it caused."""
        out: dict[str, Any] = {}
        held = {t: c.pages() for t, c in self._tiers.items()}
        lost = {t: c.evictions() for t, c in self._tiers.items()}
        for i, name in enumerate(self.names):
            c = self.counters[i]
            out[name] = {
                "sequences": c.sequences,
                "prompt_tokens": c.prompt_tokens,
                "prefix_tokens_reused": c.prefix_tokens_reused,
                "refusals": c.refusals,
                "evictions_caused": self._caused[i],
                "tiers": {
                    t: {
                        "pages": held[t][i],
                        "bytes": held[t][i] * self.slot_bytes[t],
                        "evicted": lost[t][i],
                        "reserve_pages": self._reserve[t][i],
                        "limit_pages": None
                        if self._limit[t][i] == _NO_LIMIT
                        else self._limit[t][i],
                    }
                    for t in self._tiers
                },
            }
        return out

    def check(self, held: Callable[[str], Iterable[Key]]) -> None:
        """Assert the counts equal the charged pages each tier holds, not MOVING
        (``held(tier)``). Raises AssertionError."""
        for t in self._tiers:
            used = self._pages(t)
            want = [0] * len(used)
            for i, n in Counter(map(self._of.get, held(t))).items():
                if i is not None:
                    want[i] += n
            assert want == used, f"tenant pages in {t}: counted {used}, held {want}"
