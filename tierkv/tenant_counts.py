"""One tier's pages per tenant: the counts the quotas of :mod:`tierkv.tenants` read.

:class:`TierCounts` is owned by :class:`~tierkv.tenants.Tenants` (one per tier a quota can
name); the page table holds its tier's and calls it as pages arrive and leave, so that an
eviction's hooks cost one C call each (``tierkv/_tally.c``'s ``Counts``: no Python frame,
no lookup by tier name, no ``Counter``). Where the extension was not built the Python
reference runs (:class:`PyCounts`, :func:`tally_py`); tests hold both to the same results.
"""

from __future__ import annotations

import importlib
from array import array
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

from tierkv.errors import InvalidInputError

__all__ = [
    "MIXED",
    "NATIVE",
    "NO_LIMIT",
    "PyCounts",
    "PyTierCounts",
    "TierCounts",
    "tally",
    "tally_py",
]

NO_LIMIT = 1 << 62
"""A limit in pages that no tier reaches (no limit)."""
MIXED = -1
""":meth:`TierCounts.cause` of room made for several tenants' pages."""
QUOTA = -2
""":meth:`TierCounts.cause` where the quotas must choose the victims."""

Key = Hashable


def tally_py(
    of: dict[Key, int],
    keys: Sequence[Key],
    nobody: int,
    plus: list[int] | None,
    minus: list[int] | None,
) -> int:
    """For each key of ``keys``, its tenant ``i = of.get(key, nobody)``: ``plus[i] += 1`` and
    ``minus[i] -= 1`` (each list may be None). Returns the tenant every key had, or -1 when
    they differ (or ``keys`` is empty). A bad index (negative, past a list) raises
    InvalidInputError (a ValueError) with nothing changed. The reference of
    ``tierkv/_tally.c`` (one C call per batch)."""
    ids = list(map(of.get, keys, repeat(nobody)))
    if not ids:
        return -1
    first = ids[0]
    uniform = ids.count(first) == len(ids)
    tenants = (first,) if uniform else set(ids)
    for i in tenants:  # checked before anything changes
        if (
            not isinstance(i, int)
            or i < 0
            or (plus is not None and i >= len(plus))
            or (minus is not None and i >= len(minus))
        ):
            raise InvalidInputError(f"tally: tenant index {i!r} out of range")
    for i in tenants:
        c = len(ids) if uniform else ids.count(i)
        if plus is not None:
            plus[i] += c
        if minus is not None:
            minus[i] -= c
    return first if uniform else -1


def _native() -> Any:
    """The C module (``tierkv/_tally.c``), or None where it was not built."""
    try:
        return importlib.import_module(f"{__package__}._tally")
    except ImportError:
        return None


_C = _native()
NATIVE: Callable[..., int] | None = None if _C is None else _C.tally
"""The C count, or None (then :func:`tally_py` runs)."""
tally: Callable[..., int] = NATIVE or tally_py
"""The count the hooks call: one per batch (:func:`tally_py`'s contract)."""


class PyCounts:
    """Pages per tenant in one tier (held, not counting MOVING; evicted, net of put-backs)
    and the two rules' fast check: the hooks the page table calls on every eviction and
    store. The Python reference of ``tierkv/_tally.c``'s ``Counts`` (the one
    :class:`TierCounts` is built on where the extension was built: a C call per hook, not a
    Python frame).

    Args:
        of: page key -> tenant index (the tenants' charges: shared, changed in place by
            their owner, read here).
        caused: evictions caused, per tenant (shared by every tier's counts).
        reserve: pages reserved per tenant in this tier.
        limit: page limit per tenant in this tier (:data:`NO_LIMIT`: none).
    """

    __slots__ = ("_cause", "_caused", "_guards", "_limit", "_lost", "_nb", "_of", "_used")

    def __init__(
        self,
        of: dict[Key, int],
        caused: list[int],
        reserve: list[int],
        limit: list[int],
    ) -> None:
        nb = self._nb = len(reserve)  # the index of pages nobody is charged for
        if len(caused) != nb or len(limit) != nb:
            raise InvalidInputError(
                f"counts of {nb} tenants: {len(caused)} caused, {len(limit)} limits"
            )
        self._of = of
        self._used = [0] * (nb + 1)
        self._lost = [0] * (nb + 1)
        self._caused = caused
        self._guards = [(i, r) for i, r in enumerate(reserve) if r]
        self._limit = limit if any(x < NO_LIMIT for x in limit) else None
        self._cause = array("l")  # per slot of the tier: the tenant a MOVING page went for

    def bind_slots(self, capacity: int) -> None:
        """The tier has ``capacity`` slots (its page table's): each remembers the tenant its
        MOVING page was chosen for (:meth:`evicted` with slots, :meth:`put_back`)."""
        self._cause = array("l", [-1]) * capacity

    @property
    def of(self) -> dict[Key, int]:
        """Page key -> tenant index (shared, read here)."""
        return self._of

    @property
    def nobody(self) -> int:
        """The index of pages nobody is charged for (the number of tenants)."""
        return self._nb

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
    def cause(self, keys: Sequence[Key], n: int) -> int | None:
        """The tenant the ``n`` evictions making room for the pages of ``keys`` are all made
        for (None: nobody), or :data:`MIXED` when they are several tenants' (then
        :meth:`shares` splits them), or :data:`QUOTA` when the quotas bind here and the
        policy's own pick of ``n`` victims might break them (:meth:`any_pick` is False: the
        quota passes choose). Cheap: the check of every eviction."""
        if (self._guards or self._limit is not None) and not self.any_pick(n):
            return QUOTA
        m = len(keys)
        if n == 1 and m == 1:
            return self._of.get(keys[0])
        if not 0 < n <= m:
            return MIXED if n > 0 else None
        i = tally(self._of, keys if n == m else keys[m - n :], self._nb, None, None)
        return MIXED if i < 0 else (None if i == self._nb else i)

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
        are the causes (:meth:`shares` splits the room the same way)."""
        if not new:  # (nothing is evicted for no new page)
            return
        nb = self._nb
        by = tally(self._of, new, nb, self._used, None)
        if by >= 0:  # one tenant's (or nobody's), as nearly every batch
            if out:
                self.evicted(out, None if by == nb else by)
            return
        if out:  # several tenants' pages: an eviction for each of the last len(out)
            self.evicted(out, None)
            caused = self._caused
            tail = list(map(self._of.get, new[max(0, len(new) - len(out)) :]))
            for i in set(tail):
                if i is not None:
                    caused[i] += tail.count(i)

    def evicted(self, keys: Sequence[Key], by: int | None, slots: Sequence[int] = ()) -> None:
        """Pages of ``keys`` were chosen by an eviction (gone, or MOVING: a MOVING page is no
        tenant's until put back), counted against their tenants and as caused by ``by``;
        ``slots``, one per key (MOVING pages): each remembers ``by`` until put back. A bad
        index (``by``, a charge, a slot) raises InvalidInputError with nothing changed."""
        if by is not None and not 0 <= by < self._nb:
            raise InvalidInputError(f"tenant index {by!r} out of range")
        if slots:
            self._check_slots(keys, slots)
        if keys:
            tally(self._of, keys, self._nb, self._lost, self._used)
            if by is not None:
                self._caused[by] += len(keys)
        if slots:
            cause, i = self._cause, -1 if by is None else by
            for s in slots:
                cause[s] = i

    def put_back(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """MOVING pages of ``keys`` (in ``slots``, one per key) came back: an eviction that did
        not happen after all, no longer counted as one, nor as caused by the tenant each was
        chosen for. A bad index raises InvalidInputError with nothing changed."""
        if keys:
            self._check_slots(keys, slots)
            tally(self._of, keys, self._nb, self._used, self._lost)
            caused, cause = self._caused, self._cause
            for s in slots:
                if cause[s] >= 0:
                    caused[cause[s]] -= 1
                    cause[s] = -1

    def assign(self, keys: Sequence[Key], n: int, slots: Sequence[int]) -> None:
        """The victims in ``slots`` (MOVING, in the order one eviction chose them, counted
        already) made room for the pages of ``keys``: victim ``j`` for page
        ``len(keys) - n + j`` (the free room went to the first pages, as :meth:`shares` splits
        it; before the first page: for nobody). Each slot's cause becomes that page's tenant,
        the evictions caused moving with it: one pick by policy for several tenants' pages
        counts as each tenant's share picked in turn. A bad index, or more victims than ``n``,
        raises InvalidInputError with nothing changed."""
        m, k = len(keys), len(slots)
        if n < 0 or k > n:
            raise InvalidInputError(f"assign: {k} victims for room of {n}")
        nb, of, cause = self._nb, self._of, self._cause
        lo = max(0, m - n)
        ids = [of.get(key, nb) for key in keys[lo:]]
        for i in set(ids):
            if not isinstance(i, int) or not 0 <= i <= nb:
                raise InvalidInputError(f"tally: tenant index {i!r} out of range")
        if any(not 0 <= s < len(cause) for s in slots):
            raise InvalidInputError(f"a slot past the tier's {len(cause)}")
        caused = self._caused
        for j, s in enumerate(slots):
            p = m - n + j
            who = ids[p - lo] if p >= 0 else nb
            if cause[s] >= 0:
                caused[cause[s]] -= 1
            cause[s] = -1 if who == nb else who
            if who != nb:
                caused[who] += 1

    def _check_slots(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        if len(slots) != len(keys):
            raise InvalidInputError(f"{len(slots)} slots for {len(keys)} pages")
        if any(not 0 <= s < len(self._cause) for s in slots):
            raise InvalidInputError(f"a slot past the tier's {len(self._cause)}")

    def left(self, keys: Sequence[Key]) -> None:
        """Pages of ``keys`` left (dropped: not by an eviction)."""
        if keys:
            tally(self._of, keys, self._nb, None, self._used)


class _Shares:
    """:meth:`shares`, on either counts (rare: quota passes and mixed batches)."""

    __slots__ = ()
    of: dict[Key, int]
    nobody: int

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
            i = tally(self.of, keys if n == m else keys[m - n :], self.nobody, None, None)
            if i >= 0:  # (one tenant's, as nearly every batch)
                return [(None if i == self.nobody else i, n)]
            return list(Counter(map(self.of.get, keys[m - n :])).items())
        per: Counter[int | None] = Counter(map(self.of.get, keys))
        per[None] += n - m
        return list(per.items())


if TYPE_CHECKING:  # (the C type has PyCounts' contract: tierkv/_tally.pyi)
    _Base = PyCounts
else:
    _Base = PyCounts if _C is None else _C.Counts


class TierCounts(_Shares, _Base):
    """One tier's pages per tenant and the quota rules' fast check: ``tierkv/_tally.c``'s
    ``Counts`` where the extension was built, else :class:`PyCounts` (same contract and
    arguments), with :meth:`shares`."""

    __slots__ = ()


class PyTierCounts(_Shares, PyCounts):
    """:class:`TierCounts` on the Python reference (tests hold the two to the same results)."""

    __slots__ = ()
