"""Room on the device, as the tier core's waits see it: whether pages can ever fit, whether
waiting for room can succeed (pins or copies that will go), what fits now for a prefetch, and
the typed error of a wait that ran out. Part of the tier core (:class:`tierkv.tiers.TierSet`),
built from its :class:`~tierkv.core_context.CoreContext`; it changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from tierkv.core_context import CoreContext
from tierkv.errors import QuotaExceededError, StoreTimeoutError, TierFullError, TierKVError
from tierkv.eviction import DeviceEviction
from tierkv.keys import PageKey
from tierkv.page_table import PageState
from tierkv.tier_names import DEVICE

__all__ = ["DeviceRoom"]


class DeviceRoom:
    """Capacity checks and wait errors of one tier core's device tier."""

    def __init__(self, ctx: CoreContext, evict: DeviceEviction) -> None:
        self._spec = ctx.spec
        self._leased = ctx.leased  # the leased tier's name, for the user (host-first: host)
        self._table = ctx.table
        self._engine = ctx.engine
        self._evict = evict

    def device_room(self, keys: Sequence[PageKey], protect: AbstractSet[PageKey]) -> list[PageKey]:
        """The pages of ``keys`` not readable on the device (in order) that fit there now
        without evicting a page of ``protect`` or a pinned or in-flight one."""
        table = self._table
        ready = set(table.readable(keys, DEVICE))
        absent = [k for k in keys if k not in ready]
        if not absent:
            return []
        free = table.capacity(DEVICE) - table.used(DEVICE)
        junk = sum(
            1
            for k in table.keys(DEVICE)
            if k not in protect
            and table.state(k, DEVICE) == PageState.READABLE
            and not table.pins(k, DEVICE)
        )
        return absent[: max(0, free + junk)]

    def could_free(self, mine: int) -> bool:
        """Whether device pages pinned or in flight for others than the caller (who holds
        ``mine`` of them pinned) may go, or victims were put back for host copies busy with
        copies of their own, so that waiting for room can succeed."""
        t = self._table
        return t.used(DEVICE) - t.evictable(DEVICE) > mine or self._evict.lower_busy

    def copies_in_flight(self) -> bool:
        """Whether device pages are held by copies that end on their own: write-behind
        reads, loads (WRITING) or write-backs (MOVING), as opposed to leases' pins."""
        if self._evict.write_behind_pinned or self._evict.lower_busy:
            return True
        t = self._table
        return any(t.state(k, DEVICE) != PageState.READABLE for k in t.keys(DEVICE))

    def full_error(self, n: int, waited: float | None = None) -> TierFullError:
        """The error of a device with no room for ``n`` pages (after ``waited`` seconds)."""
        t = self._table
        free = t.capacity(DEVICE) - t.used(DEVICE)
        pinned = t.used(DEVICE) - t.evictable(DEVICE)
        after = f" after waiting {waited:.3g} s" if waited is not None else ""
        if self._table.quota_blocked(DEVICE):
            who = self._table.quota_refused(DEVICE)
            return QuotaExceededError(
                f"{self._leased} tier: no room for {n} pages{after} "
                f"{'' if who is None else f'of tenant {who!r} '}without taking pages of a "
                f"tenant at its reservation ({free} free, {pinned} pinned or in flight)",
                tenant=who,
            )
        return TierFullError(
            f"{self._leased} tier full{after}: {n} pages needed, {free} free, {pinned} pinned "
            f"or in flight (capacity {t.capacity(DEVICE)} pages of {self._spec.page_bytes} B)"
        )

    def ensure_fits(self, n: int) -> None:
        """Raise TierFullError at once when ``n`` pages can never be resident together."""
        cap = self._table.capacity(DEVICE)
        if n > cap:
            raise TierFullError(
                f"{self._leased} tier: {n} pages can never be resident at once (capacity {cap} "
                f"pages of {self._spec.page_bytes} B)"
            )

    def stuck(self, todo: list[PageKey], timeout: float | None) -> TierKVError:
        """The error of a deadline passed: pages still in flight (StoreTimeoutError), or no
        room for the missing ones (TierFullError)."""
        table = self._table
        safe = set(self._evict.with_lower(todo))
        busy = [k for k in table.held(todo) if k not in safe]
        busy += table.present(todo, DEVICE)
        waited = self._engine.timeout if timeout is None else timeout
        if busy:
            return StoreTimeoutError(
                f"device tier: {len(busy)} pages in flight did not land in {waited:.3g} s"
            )
        return self.full_error(len(todo), waited)
