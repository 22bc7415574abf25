"""The eviction-policy interface.

A policy tracks the resident pages of **one tier** and chooses victims. The page table owns the
pages' state; it tells the policy about arrivals (:meth:`insert`), uses (:meth:`touch`) and
departures that were not evictions (:meth:`remove`), and asks for a victim with
:meth:`evict`, passing a predicate that says which pages may go (pinned, moving and half-written
pages may not). Every operation is O(1) amortized.

Policies may also use what a KV workload knows, passed as a :class:`PageHint` on insert: how deep
the page sits in its prefix chain, its parent in the chain, whether it is the last (usually
one-shot) block of a request, how many blocks that request has, and how much of it was already a
hit. :meth:`admit` may decline a page outright.

A policy may also work on the page table's **slots** (small ints, one per page) instead of keys:
one that sets :attr:`EvictionPolicy.slot_aware` is bound to a tier with :meth:`bind_slots` and
then hears only of slots (``insert_slots``, ``touch_slots``, ``remove_slots``, ``evict_slots``),
so it can keep array-backed structures and never hash a key. Other policies hear only of keys;
their slot methods forward to the key methods, so a key-based policy needs nothing new.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

Key = Hashable
CanEvict = Callable[[Key], bool]
CanEvictSlot = Callable[[int], bool]


@dataclass(frozen=True, slots=True)
class PageHint:
    """What the caller knows about a page being inserted.

    Attributes:
        depth: index of the block in its prefix chain (0 = first block of the prompt).
        last: the block is the last full block the request brought (often never reused).
        prefix_hits: how many leading blocks of the request that brought it were hits.
        parent: the key of the block before it in the prefix chain (``None`` for the first
            block, or when unknown). Chain-aware policies use it: a block is only useful while
            its parent is resident, so evicting a parent strands its children.
        blocks: how many blocks the request that brought it has (0 when unknown). Short
            conversations are resumed far more often than long one-off prompts.
    """

    depth: int = 0
    last: bool = False
    prefix_hits: int = 0
    parent: Key | None = None
    blocks: int = 0


NO_HINT = PageHint()


class EvictionPolicy(ABC):
    """Chooses which resident page of a tier leaves next.

    Subclasses implement :meth:`insert`, :meth:`touch`, :meth:`remove`, :meth:`evict` and
    ``__len__``/``__contains__``. The page table guarantees that ``insert`` is only called for a
    key that is not resident and ``touch``/``remove`` only for resident ones.
    """

    name: ClassVar[str] = "base"
    slot_aware: ClassVar[bool] = False
    """True for policies that implement :meth:`bind_slots` and :meth:`evict_slots`; the page
    table then tells them about slots only, never keys."""

    @abstractmethod
    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        """Record a newly resident page."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """Record a use of a resident page."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget a resident page that left the tier without being chosen as a victim."""

    @abstractmethod
    def evict(self, can_evict: CanEvict) -> Key | None:
        """Choose a victim among resident pages with ``can_evict(key)`` true and forget it.

        Returns ``None`` when no resident page may be evicted.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        """Whether a new page should enter a *full* tier at all (default: always)."""
        return True

    def stats(self) -> dict[str, float]:
        """Counters of the policy's own decisions, for reports (none by default)."""
        return {}

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        """Choose and forget up to ``n`` victims (fewer only when no more may be evicted)."""
        out: list[Key] = []
        for _ in range(n):
            victim = self.evict(can_evict)
            if victim is None:
                break
            out.append(victim)
        return out

    def insert_many(self, keys: Sequence[Key], hints: Sequence[PageHint]) -> None:
        """Record several newly resident pages, in order (``hints`` aligned with ``keys``)."""
        for k, h in zip(keys, hints):
            self.insert(k, h)

    def touch_many(self, keys: Iterable[Key]) -> None:
        """Record uses of several resident pages, in order."""
        for k in keys:
            self.touch(k)

    # -- the slot interface (see the module docstring) --------------------------------------
    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        """Attach to a tier of ``capacity`` slots (``slot_of``: its key -> slot map, read-only).

        Called once, before any other call, and only when :attr:`slot_aware` is true; afterwards
        the page table calls only the ``*_slots`` methods. Raises TypeError here.
        """
        raise TypeError(f"policy {self.name!r} is not slot-aware")

    def insert_slots(
        self, slots: Sequence[int], keys: Sequence[Key], hints: Sequence[PageHint]
    ) -> None:
        """Record newly resident pages (``slots``, ``keys`` and ``hints`` aligned)."""
        self.insert_many(keys, hints)

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Record uses of resident pages, in order (``slots`` aligned with ``keys``)."""
        self.touch_many(keys)

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Forget resident pages that left without being chosen as victims."""
        for k in keys:
            self.remove(k)

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """Choose and forget up to ``n`` victim slots (fewer only when no more may be evicted).

        ``can_evict`` says which slots may go; ``None`` means every resident one may. Only
        slot-aware policies implement it. Raises TypeError here.
        """
        raise TypeError(f"policy {self.name!r} is not slot-aware")
