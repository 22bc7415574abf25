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

The contract (``docs/policies.md`` has the long form):

* ``evict*`` returns ``min(n, evictable)`` victims, never fewer: a page that becomes evictable
  during the call (a chain orphan, a page promoted between queues) is considered in it.
* A page passed over because it may not be evicted goes to the back of its queue (that keeps a
  scan O(1) amortized); its counters do not change.
* :meth:`restore` undoes an eviction whose page did not leave after all (a failed write-back):
  the page returns to the head of the queue it left, with the counters it had, and the ghost or
  history entry the eviction made is taken back. It is not a use.
* :meth:`miss` hears of requested pages that are not resident (ARC takes ghost feedback from
  it); touching or removing a key the policy does not hold raises
  :class:`~tierkv.errors.UnknownPageError`.
* :meth:`candidates` ranks the next victims without changing anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from tierkv.errors import UnknownPageError

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

    def end_batch(self) -> None:
        """Forget the batch :meth:`admit` was judging: the page table calls it when a store
        it admitted pages for is refused (no room), so nothing of that batch is taken for
        resident later. Default: nothing."""
        return None

    def miss(self, keys: Iterable[Key]) -> None:
        """Hear of requested pages that are not resident (a lookup or touch that missed).
        Default: nothing; ARC adapts its target on a ghost hit."""
        return None

    def evicted_state(self, keys: Sequence[Key]) -> list[object]:
        """What :meth:`restore` needs to put back ``keys``, read right after they were evicted
        (before any other call). Default: nothing per page."""
        return [None] * len(keys)

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        """Undo the eviction of ``keys`` (in victim order), with ``states`` from
        :meth:`evicted_state`: back at the head of the queue each left, counters unchanged.

        The default inserts them as new pages, which is exact for a policy that keeps no
        per-page state beyond its order; the built-in policies override it.
        """
        self.insert_many(keys, [NO_HINT] * len(keys))

    def candidates(self, n: int, can_evict: CanEvict | None = None) -> list[Key]:
        """The next ``n`` victims, best first, as :meth:`evict_many` would choose them now,
        without changing anything. ``None`` for ``can_evict``: every page may go.

        The default evicts on a copy of the policy (``copy.deepcopy``); the built-in
        policies walk their queues instead where that is exact.
        """
        import copy

        clone = copy.deepcopy(self)
        return clone.evict_many(n, can_evict or _always)

    def evict_exactly(self, n: int, can_evict: CanEvict) -> list[Key] | None:
        """Evict exactly ``n`` pages, or none: ``None`` (and nothing evicted) when fewer than
        ``n`` may go. Pages passed over may still move to the back of their queues."""
        out = self.evict_many(n, can_evict)
        if len(out) < n:
            self.restore(out, self.evicted_state(out))
            return None
        return out

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

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        """:meth:`evicted_state` for slot victims (``slots`` aligned with ``keys``)."""
        return self.evicted_state(keys)

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        """:meth:`restore` for slot victims (``slots``, ``keys``, ``states`` aligned)."""
        self.restore(keys, states)

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """:meth:`candidates` in slot mode. Raises TypeError for a policy that is not
        slot-aware."""
        raise TypeError(f"policy {self.name!r} is not slot-aware")

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """Choose and forget up to ``n`` victim slots (fewer only when no more may be evicted).

        ``can_evict`` says which slots may go; ``None`` means every resident one may. Only
        slot-aware policies implement it. Raises TypeError here.
        """
        raise TypeError(f"policy {self.name!r} is not slot-aware")


class OneByOne(EvictionPolicy):
    """A key policy that evicts one page at a time (:meth:`_evict_one`) and keeps what
    :meth:`restore` needs of each victim of the last eviction call in ``_recent``."""

    _recent: dict[Key, object]

    @abstractmethod
    def _evict_one(self, can_evict: CanEvict) -> Key | None:
        """Evict one page (recording ``_recent[victim]``), or return None."""

    def evict(self, can_evict: CanEvict) -> Key | None:
        self._recent = {}
        return self._evict_one(can_evict)

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        self._recent = {}
        out: list[Key] = []
        while len(out) < n:
            victim = self._evict_one(can_evict)
            if victim is None:
                break
            out.append(victim)
        return out

    def evicted_state(self, keys: Sequence[Key]) -> list[object]:
        return [self._recent[k] for k in keys]


def _always(key: Key) -> bool:
    return True


def unknown(key: Key, policy: str) -> UnknownPageError:
    """The error a policy raises for a key it does not hold."""
    return UnknownPageError(f"policy {policy!r} holds no page {key!r}")
