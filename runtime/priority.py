"""The order in which the transfer engine dispatches pending work."""

from __future__ import annotations

import enum

__all__ = ["Priority"]


class Priority(enum.IntEnum):
    """Dispatch order of pending batches: lower value goes first."""

    DEMAND = 0  # a load that compute is waiting for
    PREFETCH = 1  # a load for a step announced ahead
    WRITEBACK = 2  # an eviction to a lower tier
