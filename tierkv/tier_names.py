"""The names of the tiers, from the fastest to the slowest."""

from __future__ import annotations

__all__ = ["COLD", "DEVICE", "DISK", "HOST", "TIERS"]

DEVICE, HOST, COLD = "device", "host", "cold"
TIERS = (DEVICE, HOST, COLD)  # the tiers of the tier core (TierSet)
DISK = "disk"  # a plug-in tier below the host (tierkv.tier, tierkv.disk.tier)
