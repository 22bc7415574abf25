"""`PageSource`: what the store and the prefix helpers need from any remote tier.

Part of the core: the store knows a remote tier only by this protocol (its clients live in
:mod:`tierkv.remote.sources`, which re-exports it).

A page source holds content-addressed pages somewhere outside this process: a peer's page
server (`RemoteTier`), a Redis / Valkey deployment (`RedisTier`), or a user's own backend.
Three batch calls are enough: how many leading pages it holds, read them into local slots,
write local pages to it. Pages are rows of a ``[num_slots, page_bytes]`` uint8 array.

Page checksums (tierkv.page_sums): a source that sets ``checks_pages = True`` takes them
further, ``load(..., check=PageCheck())`` verifying what it read and reporting the pages'
checksums and how many were corrupt, ``publish(..., sums=[...])`` declaring the pages'
checksums to the far side. `load_checked` and `publish_checked` call any source the right way:
for a source that does not check, the store computes the checksums of what landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from tierkv.page_sums import PageCheck

__all__ = ["PageSource", "checks_pages", "load_checked", "publish_checked", "tier_label"]


@runtime_checkable
class PageSource(Protocol):
    """A remote tier the store can read pages from and write pages to."""

    async def lookup(self, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` the source holds (a hint: `load` decides)."""
        ...

    async def load(self, keys: list[bytes], array: npt.NDArray[np.uint8], slots: list[int]) -> int:
        """Read the leading pages of ``keys`` into ``array[slots[i]]``; returns how many arrived
        intact. Rows past the returned count may have been written and hold no page."""
        ...

    async def publish(
        self, keys: list[bytes], array: npt.NDArray[np.uint8], slots: list[int]
    ) -> int:
        """Write ``array[slots[i]]`` as page ``keys[i]``; returns the pages newly stored."""
        ...


def checks_pages(source: object) -> bool:
    """Whether ``source`` verifies page checksums (``checks_pages = True``)."""
    return getattr(source, "checks_pages", False) is True


def tier_label(source: object) -> str:
    """The label of ``source``'s corrupt pages in the store's counters (``peer`` by default)."""
    label = getattr(source, "tier_label", "peer")
    return label if isinstance(label, str) else "peer"


async def load_checked(
    source: PageSource,
    keys: list[bytes],
    array: npt.NDArray[np.uint8],
    slots: list[int],
    check: PageCheck,
) -> int:
    """``source.load``, handing it ``check`` when it verifies page checksums."""
    if checks_pages(source):
        return await source.load(keys, array, slots, check=check)  # type: ignore[call-arg]
    return await source.load(keys, array, slots)


async def publish_checked(
    source: PageSource,
    keys: list[bytes],
    array: npt.NDArray[np.uint8],
    slots: list[int],
    sums: Sequence[int],
) -> int:
    """``source.publish``, declaring the pages' checksums when it takes them."""
    if checks_pages(source) and len(sums) == len(keys):
        return await source.publish(keys, array, slots, sums=list(sums))  # type: ignore[call-arg]
    return await source.publish(keys, array, slots)
