"""Who hears of pages leaving the host tier: the page server's listeners, the remote tier's
offer and the lower chain's spill. Part of the tier core (:mod:`tierkv.tiers`): the host room
(:class:`~tierkv.lower_tiers.ColdStorage`), the write-back
(:class:`~tierkv.eviction.DeviceEviction`) and the remote glue
(:class:`~tierkv.remote_glue.RemoteGlue`) share one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import cast

from tierkv.keys import PageKey

__all__ = ["Departures", "Offer"]

Offer = Callable[[list[tuple[PageKey, int]]], Awaitable[None]]


class Departures:
    """Who hears of pages leaving the host tier: listeners (told the keys after they left) and
    the remote tier's offer (given the exact bytes before they are compressed or dropped)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[list[PageKey]], None]] = []
        self.offer: Offer | None = None
        self.spill: Offer | None = None  # the tiers below the host (tierkv.chain)

    def left(self, keys: Sequence[object]) -> None:
        """Pages left the host tier (evicted, dropped, moved to cold): tell the listeners."""
        if keys and self.listeners:
            gone = cast(list[PageKey], list(keys))
            for listener in list(self.listeners):
                listener(gone)

    async def offer_remote(self, victims: list[tuple[PageKey, int]]) -> None:
        """Offer host pages about to leave (pinned or MOVING, so their bytes hold) to the
        remote tier, if any; bounded and best-effort (the remote counts its failures)."""
        if self.offer is not None and victims:
            await self.offer(victims)

    async def spill_below(self, victims: list[tuple[PageKey, int]]) -> None:
        """Give host pages about to leave (pinned or MOVING) to the tiers below the host, if
        any; their failures are counted there, a timeout or a cancellation raised (the pages
        then stay in the host tier)."""
        if self.spill is not None and victims:
            await self.spill(victims)
