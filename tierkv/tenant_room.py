"""Device room for new pages of several tenants (a batched step's): asked one tenant at a time.

The page table splits room made for a batch of several tenants' pages into each tenant's share
(:meth:`tierkv.tenant_counts.TierCounts.shares`), but a batch's refusal names one tenant
only, whichever page came first. :func:`reserve_by_tenant` asks for each tenant's part on its own
(:meth:`~tierkv.tenants.Tenants.parts`: the tenant owed most of its reservation first), so each
part's evictions keep the quotas for its tenant and a refusal
(:class:`~tierkv.errors.QuotaExceededError`) names the tenant whose part found no room; all or
nothing. :func:`reserve_now_by_tenant` is the same with no wait (a step plan's group loaded at
once: :meth:`~tierkv.device_loads.DeviceLoads.reserve_now` per part).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tierkv.keys import PageKey
from tierkv.tenants import Tenants
from tierkv.tier_names import DEVICE
from tierkv.tiers import TierSet

__all__ = ["reserve_by_tenant", "reserve_now_by_tenant"]


async def reserve_by_tenant(
    tiers: TierSet,
    tenants: Tenants,
    keys: Sequence[PageKey],
    *,
    mine: int = 0,
    timeout: float | None = None,
) -> list[int]:
    """:meth:`TierSet.reserve_device` of ``keys``, one tenant's part at a time; returns the
    slots in the order of ``keys``. On any error the parts reserved already are undone (the
    pages reserved so far count as the caller's: never waited on). Raises what
    ``reserve_device`` raises."""
    tiers.room.ensure_fits(len(keys))
    parts = cast(list[Sequence[PageKey]], tenants.parts(DEVICE, keys))
    if len(parts) == 1:
        return await tiers.reserve_device(keys, mine=mine, timeout=timeout)
    slot_of: dict[PageKey, int] = {}
    done: list[PageKey] = []
    try:
        for part in parts:
            slots = await tiers.reserve_device(part, mine=mine + len(done), timeout=timeout)
            slot_of.update(zip(part, slots))
            done += part
    except BaseException:
        if done:
            tiers.abort_device(done, pinned=False, owned=False)
        raise
    return [slot_of[k] for k in keys]


def reserve_now_by_tenant(
    tiers: TierSet, tenants: Tenants, keys: Sequence[PageKey]
) -> list[int] | None:
    """:func:`reserve_by_tenant` with no wait: each tenant's part reserved by
    :meth:`~tierkv.device_loads.DeviceLoads.reserve_now`; the slots in the order of ``keys``,
    or None with nothing reserved where a part's room is not there without a wait. Raises
    what ``reserve_now`` raises (nothing reserved then)."""
    parts = cast(list[Sequence[PageKey]], tenants.parts(DEVICE, keys))
    if len(parts) == 1:
        return tiers.pages.reserve_now(keys)
    slot_of: dict[PageKey, int] = {}
    done: list[PageKey] = []
    try:
        for part in parts:
            slots = tiers.pages.reserve_now(part)
            if slots is None:
                break
            slot_of.update(zip(part, slots))
            done += part
        else:
            return [slot_of[k] for k in keys]
    except BaseException:
        if done:
            tiers.abort_device(done, pinned=False, owned=False)
        raise
    if done:
        tiers.abort_device(done, pinned=False, owned=False)
    return None
