"""`PageSource`: what the store and the prefix helpers need from any remote tier.

Part of the core: the store knows a remote tier only by this protocol (its clients live in
:mod:`tierkv.remote.sources`, which re-exports it).

A page source holds content-addressed pages somewhere outside this process: a peer's page
server (`RemoteTier`), a Redis / Valkey deployment (`RedisTier`), or a user's own backend.
Three batch calls are enough: how many leading pages it holds, read them into local slots,
write local pages to it. Pages are rows of a ``[num_slots, page_bytes]`` uint8 array.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["PageSource"]


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
