"""What the tier core (:class:`tierkv.tiers.TierSet`) hands each of its collaborators: one
record instead of a dozen positional arguments, built once when the core opens."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tierkv.departures import Departures
from tierkv.owners import Owners
from tierkv.page_table import PageTable
from tierkv.runtime import Arena, TransferEngine, TransferStats
from tierkv.spec import KVSpec
from tierkv.stats import TierStats
from tierkv.tier import Moves
from tierkv.tier_names import DEVICE, HOST
from tierkv.timeline import Timeline
from tierkv.waits import Changes

__all__ = ["CoreContext"]


@dataclass(frozen=True, slots=True)
class CoreContext:
    """The tier core's shared state, as its collaborators see it.

    ``table`` and ``arenas`` are the core's own (the collaborators change page state only
    through the page table, each for its concern); ``moves`` the handlers of every move between
    two media; ``progress`` is called after every change that may free device room or land a
    page in flight (it wakes the waiters of ``changes`` and reaps idle doomed pages);
    ``lower`` the tiers below the device that hold exact or encoded copies, fastest first;
    ``top`` the tier whose pages leave to the remote tier and the chain below (the host tier;
    with none, the leased tier itself: a host-first store's, or a device alone); ``leased``
    the leased tier's name as the user sees it (``host`` in a host-first store, whose leased
    pages the core keeps in its ``device`` column, in pinned host memory); ``media`` each
    column's medium, where its arena lives and the key of its moves in ``moves`` (a host-first
    store's ``device`` column is in host memory: its medium is ``host``).
    """

    spec: KVSpec
    table: PageTable
    arenas: dict[str, Arena]
    engine: TransferEngine
    moves: Moves
    owners: Owners
    departures: Departures
    stats: TierStats
    timeline: Timeline
    progress: Callable[[], None]
    changes: Changes
    lower: tuple[str, ...]
    top: str = HOST
    leased: str = DEVICE
    media: Mapping[str, str] = field(default_factory=lambda: {DEVICE: DEVICE, HOST: HOST})

    def medium(self, column: str) -> str:
        """The medium of a column of the page table (the column's own name but for a
        host-first store's leased column)."""
        return self.media.get(column, column)

    def copied(self, what: str, stream: str, st: TransferStats, pages: int) -> None:
        """Count a page copy that ended: its seconds in the stats, its span on the timeline."""
        self.stats.copy_s += st.copy_s
        self.timeline.span(
            what, stream, st.started_at, st.finished_at, pages=pages, queue_wait_s=st.queue_wait_s
        )
