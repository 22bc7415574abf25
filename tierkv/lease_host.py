"""What a lease needs of its store: :class:`LeaseHost`, the small public surface that
:class:`tierkv.store.KVStore` implements (the lease never imports the store)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tierkv.admission import Admission
from tierkv.sequence import SequenceState
from tierkv.spec import KVSpec
from tierkv.stats import StoreCounters
from tierkv.step_claims import StepClaims
from tierkv.tenants import Tenants
from tierkv.tiers import TierSet
from tierkv.timeline import Timeline
from tierkv.turns import TurnBudget

__all__ = ["LeaseHost"]


class LeaseHost(Protocol):
    """What a lease needs of its store (:class:`tierkv.store.KVStore` implements it)."""

    spec: KVSpec
    timeout: float
    counters: StoreCounters
    timeline: Timeline
    turns: TurnBudget
    steps: StepClaims  # the sequences in an entered step plan (tierkv.step_claims)
    tenants: Tenants | None  # charged for the pages sequences make (tierkv.tenants)

    @property
    def closed(self) -> bool:
        """True once the store is closed."""
        ...

    @property
    def tiers(self) -> TierSet:
        """The tier core (raises StoreClosedError when closed)."""
        ...

    @property
    def admission(self) -> Admission:
        """The FIFO admission of leases to the device."""
        ...

    def is_live(self, seq: SequenceState) -> bool:
        """True while ``seq`` is a live sequence of the store (not released, id not reused)."""
        ...

    def lease_began(self, keys: Sequence[bytes]) -> None:
        """A lease pinned ``keys``: compute reads them now (prefetch accounting)."""
        ...

    def lease_ended(self, seqs: Sequence[SequenceState], pinned: Sequence[bytes]) -> None:
        """A lease let go of ``pinned`` (already unpinned): recency, and publishing the full
        blocks of the live ``seqs``."""
        ...

    def lease_wrote(self, keys: list[bytes]) -> None:
        """Pages a lease wrote: copy them down in the background (if the store does)."""
        ...
