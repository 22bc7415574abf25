"""The eviction-policy interface.

A policy tracks the resident pages of **one tier** and chooses victims. The page table owns the
pages' state and their slots (small ints, one per page); it binds each policy to a tier once
(:meth:`EvictionPolicy.bind_slots`) and then tells it of pages by slot: arrivals
(``insert_slots``), uses (``touch_slots``), departures that were not evictions
(``remove_slots``), and asks for victims (``evict_slots``), passing a predicate that says which
slots may go (pinned, moving and half-written pages may not). Keys come along where a policy
needs them (its history outlives the slot), so a policy keeps array-backed structures
(``links.py``) and hashes a key only for what must survive eviction.

Policies may also use what a KV workload knows, passed on insert either per page
(:class:`PageHint`) or once for a run of consecutive blocks of one request's chain
(:class:`ChainHint`, from which the policy derives each page's hint): how deep the page sits in
its prefix chain, its parent in the chain, whether it is the last (usually one-shot) block of a
request, how many blocks that request has, and how much of it was already a hit.
:meth:`EvictionPolicy.admit_many` may decline pages outright.

The contract (``docs/policies.md`` has the long form):

* ``evict_slots`` returns ``min(n, evictable)`` victims, never fewer: a page that becomes
  evictable during the call (a chain orphan, a page promoted between queues) is considered in it.
* A page passed over because it may not be evicted goes to the back of its queue (that keeps a
  scan O(1) amortized); its counters do not change.
* ``restore_slots`` undoes an eviction whose page did not leave after all (a failed write-back):
  the page returns where it was in the queue it left (the head for a victim the policy chose,
  its place among the others for one the caller chose: ``evict_chosen``), with the counters it
  had, and the ghost or history entry the eviction made is taken back. It is not a use.
* ``evict_chosen`` takes the caller's victims from where they are; no other page moves.
* :meth:`EvictionPolicy.miss` hears of requested pages that are not resident (ARC takes ghost
  feedback from it).
* ``candidate_slots`` ranks the next victims without changing anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from tierkv.errors import TierKVError

Key = Hashable
"""What the page table and the policies name a page by: any hashable. A store's pages are
:data:`tierkv.keys.PageKey` (bytes: a block key and two bytes of layer, from
:func:`tierkv.keys.page_key`); the page table on its own takes any hashable key."""
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


@dataclass(frozen=True, slots=True)
class ChainHint:
    """The hints of consecutive blocks of one request's prefix chain, in one object.

    Pass it instead of a :class:`PageHint` per block: block ``i`` of the keys stored gets
    ``PageHint(depth + i, last, prefix_hits, parent if i == 0 else keys[i - 1], blocks)``, where
    ``last`` is true for the block at depth ``blocks - 1`` (the request's last block).

    Attributes:
        depth: the depth of the first key in its chain.
        parent: the block before the first key (``None``: the first key starts the chain).
        prefix_hits: how many leading blocks of the request were hits.
        blocks: how many blocks the request has (0 when unknown: no block is the last).
    """

    depth: int = 0
    parent: Key | None = None
    prefix_hits: int = 0
    blocks: int = 0

    def hints(self, keys: Sequence[Key], kept: Sequence[bool] | None = None) -> list[PageHint]:
        """One :class:`PageHint` per key of ``keys`` (the run this hint describes), or only
        for the keys whose ``kept`` is true."""
        d, last, hits, n = self.depth, self.blocks - 1, self.prefix_hits, self.blocks
        parents = [self.parent, *keys[:-1]]
        return [
            PageHint(d + i, d + i == last, hits, parents[i], n)
            for i in range(len(keys))
            if kept is None or kept[i]
        ]


@dataclass(frozen=True, slots=True)
class ChainPart:
    """The pages of a :class:`ChainHint`'s run that admission kept: ``keys[i]`` for each
    ``kept[i]``, each with the hint the whole run gives it (the page table passes this to
    ``insert_slots`` when a policy declined some pages of a chain; no hint object per page).
    """

    chain: ChainHint
    keys: Sequence[Key]
    kept: Sequence[bool]

    def hints(self) -> list[PageHint]:
        """One :class:`PageHint` per kept page."""
        return self.chain.hints(self.keys, self.kept)


Hints = Sequence[PageHint] | ChainHint | ChainPart | None
"""Hints for a batch of new pages: one per page, one for the run (or the kept part of a run),
or none."""


def page_hints(keys: Sequence[Key], hints: Hints) -> Sequence[PageHint]:
    """``hints`` as one :class:`PageHint` per key (``NO_HINT`` for None)."""
    if hints is None:
        return [NO_HINT] * len(keys)
    if isinstance(hints, ChainHint):
        return hints.hints(keys)
    if isinstance(hints, ChainPart):
        return hints.hints()
    return hints


class EvictionPolicy(ABC):
    """Chooses which resident page of a tier leaves next (see the module docstring).

    The page table guarantees that ``insert_slots`` names slots the policy does not hold and
    ``touch_slots`` / ``remove_slots`` only slots it holds, and that no other call comes before
    :meth:`bind_slots`.
    """

    name: ClassVar[str] = "base"
    admits: ClassVar[bool] = False
    """True for a policy whose :meth:`admit_many` may decline pages or learns from being asked
    (the page table skips the call for the others)."""

    _slot_of: Mapping[Key, int] = {}

    @abstractmethod
    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        """Attach to a tier of ``capacity`` slots (``slot_of``: its key -> slot map, read-only).

        Called once, before any other call. Raises TierKVError when the policy is bound.
        """

    @abstractmethod
    def insert_slots(self, slots: Sequence[int], keys: Sequence[Key], hints: Hints) -> None:
        """Record newly resident pages, in order (``slots`` and ``keys`` aligned; ``hints``
        one per page, a :class:`ChainHint` for the run, or None)."""

    @abstractmethod
    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Record uses of resident pages, in order (``slots`` aligned with ``keys``)."""

    @abstractmethod
    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Forget resident pages that left without being chosen as victims."""

    @abstractmethod
    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """Choose and forget up to ``n`` victim slots, best first (fewer only when no more may
        be evicted). ``can_evict`` says which slots may go; ``None``: every one may."""

    def evict_chosen(self, slots: Sequence[int]) -> list[int]:
        """Forget ``slots`` as victims the caller chose (each held and evictable, for example
        the pages an announced order reads last), as :meth:`evict_slots` takes victims;
        returns them in the order they went. Default: :meth:`evict_slots` limited to them (a
        scan of the policy's queues, which moves the pages it passes over to the back of
        theirs); every built-in policy takes them from where they are, nothing else moved."""
        return self.evict_slots(len(slots), frozenset(slots).__contains__)

    @abstractmethod
    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        """The slots :meth:`evict_slots` would return now, without changing anything."""

    @abstractmethod
    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        """Undo the eviction of ``slots`` (in victim order; ``keys`` their keys now, ``states``
        from :meth:`evicted_state_slots`): back where each was in the queue it left (the head
        for the policy's own victims; behind the page it was behind for victims
        :meth:`evict_chosen` took, the head when that page left its queue since), counters
        unchanged, ghost or history entries taken back. Not a use."""

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        """What :meth:`restore_slots` needs to put back victims, read right after they were
        evicted (before any other call). Default: nothing per page (a victim's slot keeps its
        per-slot state until it is reused)."""
        return [None] * len(slots)

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def holds(self, s: int) -> bool:
        """Whether slot ``s`` is one of the policy's pages."""

    def __contains__(self, key: object) -> bool:
        s = self._slot_of.get(key)
        return s is not None and self.holds(s)

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        """Whether a new page should enter a *full* tier at all (default: always)."""
        return True

    def admit_many(self, keys: Sequence[Key], hints: Hints) -> list[bool] | None:
        """:meth:`admit` for a batch of new pages (none inserted yet), in order: a verdict per
        key, or None when every one is admitted."""
        admit = self.admit
        kept = [admit(k, h) for k, h in zip(keys, page_hints(keys, hints))]
        return None if all(kept) else kept

    def end_batch(self) -> None:
        """Forget the batch :meth:`admit_many` was judging: the page table calls it when a
        store it admitted pages for is refused (no room), so nothing of that batch is taken for
        resident later. Default: nothing."""
        return None

    def miss(self, keys: Iterable[Key]) -> None:
        """Hear of requested pages that are not resident (a lookup or touch that missed).
        Default: nothing; ARC adapts its target on a ghost hit."""
        return None

    def stats(self) -> dict[str, float]:
        """Counters of the policy's own decisions, for reports (none by default)."""
        return {}

    def _bind(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        """Record the binding; raises TierKVError when the policy is bound already."""
        if getattr(self, "_bound", False):
            raise TierKVError(f"policy {self.name!r} is bound to a tier already")
        self._bound = True
        self._slot_of = slot_of
