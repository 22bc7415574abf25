"""One tier's pages per tenant: the counts the quotas of :mod:`tierkv.tenants` read.

:class:`TierCounts` is owned by :class:`~tierkv.tenants.Tenants` (one per tier a quota can
name); the page table holds its tier's and calls it as pages arrive and leave, so that an
eviction's hooks cost a method call on one small object each (no lookup by tier name, no
``Counter``): a page's tenant is one dict lookup (``map`` over the batch, in C) and a batch's
count one ``list.count`` (a batch is nearly always one tenant's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from itertools import repeat

__all__ = ["NO_LIMIT", "TierCounts"]

NO_LIMIT = 1 << 62
"""A limit in pages that no tier reaches (no limit)."""

Key = Hashable


def _add(counts: list[int], ids: list[int], sign: int) -> None:
    """Add ``sign`` to ``counts[i]`` for each ``i`` of ``ids`` (a batch's tenant indices):
    one C-level count when the batch is one tenant's (the common case: a sequence's pages),
    else one per tenant in it (few)."""
    if not ids:
        return
    first = ids[0]
    n = ids.count(first)
    if n == len(ids):
        counts[first] += sign * n
        return
    for i in set(ids):
        counts[i] += sign * ids.count(i)


class TierCounts:
    """Pages per tenant in one tier (held, not counting MOVING; evicted, net of put-backs)
    and the two rules' fast check.

    Args:
        of: page key -> tenant index (the tenants' charges: shared, changed in place by
            their owner, read here).
        caused: evictions caused, per tenant (shared by every tier's counts).
        reserve: pages reserved per tenant in this tier.
        limit: page limit per tenant in this tier (:data:`NO_LIMIT`: none).
    """

    __slots__ = ("_caused", "_guards", "_limit", "_lost", "_nb", "_nobody", "_of", "_used")

    def __init__(
        self, of: dict[Key, int], caused: list[int], reserve: list[int], limit: list[int]
    ) -> None:
        nb = self._nb = len(reserve)  # the index of pages nobody is charged for
        self._of = of
        self._nobody = repeat(nb)  # (``map(of.get, keys, self._nobody)``: nobody's -> nb)
        self._used = [0] * (nb + 1)
        self._lost = [0] * (nb + 1)
        self._caused = caused
        self._guards = [(i, r) for i, r in enumerate(reserve) if r]
        self._limit = limit if any(x < NO_LIMIT for x in limit) else None

    @property
    def active(self) -> bool:
        """Whether evictions here must check the quotas (a reservation or a limit binds)."""
        return bool(self._guards) or self._limit is not None

    def pages(self) -> list[int]:
        """Pages held per tenant (not counting MOVING)."""
        return self._used[: self._nb]

    def evictions(self) -> list[int]:
        """Pages evicted per tenant (suffered; put-backs not counted)."""
        return self._lost[: self._nb]

    # -- the page table's hooks: one call per batch ------------------------------------------
    def maker(self, keys: Sequence[Key]) -> int | None:
        """The tenant charged for the first of ``keys`` that has one (the cause of the
        evictions storing them makes); None for none."""
        of = self._of
        for k in keys:  # (the first key has one but for unowned pages: no generator)
            i = of.get(k)
            if i is not None:
                return i
        return None

    def shares(self, keys: Sequence[Key], n: int) -> list[tuple[int | None, int]]:
        """The ``n`` evictions that make room for the pages of ``keys``, split by the tenant
        each is made for: ``(tenant, evictions)``, in the order of ``keys``. The free room
        (``len(keys) - n`` slots) goes to the first pages, an eviction to each of the rest
        (as :meth:`replaced` counts a store's); evictions beyond the pages are made for
        nobody: rule 2 lets a tenant's pages go below its reservation only for as many of
        its own as arrive."""
        m = len(keys)
        if n <= 0:
            return []
        if n <= m:
            if m == 1:
                return [(self._of.get(keys[0]), n)]
            rest = list(map(self._of.get, keys[m - n :]))
            if rest.count(rest[0]) == n:  # (one tenant's, as nearly every batch)
                return [(rest[0], n)]
            return list(Counter(rest).items())
        out = list(Counter(map(self._of.get, keys)).items())
        out.append((None, n - m))
        return out

    def any_pick(self, n: int) -> bool:
        """Whether any ``n`` victims keep the quotas: nobody is over a limit (rule 1 has
        nothing to say) and each tenant with a reservation has ``n`` pages above it (rule 2
        holds whichever pages go), so the policy's own pick stands unchecked."""
        used = self._used
        if self._limit is not None and self.over_limit():
            return False
        for i, r in self._guards:  # noqa: SIM110 - a loop: no generator per eviction
            if used[i] - r < n:
                return False
        return True

    def over_limit(self) -> bool:
        """Whether a tenant is over its limit (rule 1 then picks the victims)."""
        lim = self._limit
        return lim is not None and any(u > x for u, x in zip(self._used, lim))

    def replaced(self, out: Sequence[Key], new: Sequence[Key]) -> None:
        """Pages of ``new`` arrived in the room of ``out``'s, evicted for them: the free
        room went to ``new``'s first pages, an eviction to each of the rest, whose tenants
        are the causes (:meth:`Tenants.shares` splits the room the same way)."""
        n = len(new)
        if not n:  # (nothing is evicted for no new page)
            return
        nb = self._nb
        if n == 1:  # (an append's one page)
            by = self._of.get(new[0], nb)
            self._used[by] += 1
        else:
            ids = list(map(self._of.get, new, self._nobody))
            by = ids[0]
            if ids.count(by) == n:  # one tenant's (inline: this runs per batch stored)
                self._used[by] += n
            else:  # several tenants' pages: an eviction for each of the last len(out)
                _add(self._used, ids, 1)
                if out:
                    self.evicted(out, None)
                    caused = self._caused
                    tail = ids[max(0, n - len(out)) :]
                    for i in set(tail):
                        if i != nb:
                            caused[i] += tail.count(i)
                return
        if out:
            self.evicted(out, None if by == nb else by)

    def evicted(self, keys: Sequence[Key], by: int | None) -> None:
        """Pages of ``keys`` were chosen by an eviction (gone, or MOVING: a MOVING page is no
        tenant's until put back), counted against their tenants and as caused by ``by``."""
        n = len(keys)
        if not n:
            return
        if n == 1:
            i = self._of.get(keys[0], self._nb)
            self._used[i] -= 1
            self._lost[i] += 1
        else:
            ids = list(map(self._of.get, keys, self._nobody))
            i = ids[0]
            if ids.count(i) == n:  # one tenant's (inline: this runs per eviction)
                self._used[i] -= n
                self._lost[i] += n
            else:
                _add(self._used, ids, -1)
                _add(self._lost, ids, 1)
        if by is not None:
            self._caused[by] += n

    def put_back(self, keys: Sequence[Key], by: int | None) -> None:
        """MOVING pages of ``keys`` came back (an eviction made for ``by``'s pages that did
        not happen after all: no longer counted as one)."""
        if not keys:
            return
        ids = list(map(self._of.get, keys, self._nobody))
        _add(self._used, ids, 1)
        _add(self._lost, ids, -1)
        if by is not None:
            self._caused[by] -= len(keys)

    def left(self, keys: Sequence[Key]) -> None:
        """Pages of ``keys`` left (dropped: not by an eviction)."""
        if keys:
            _add(self._used, list(map(self._of.get, keys, self._nobody)), -1)
