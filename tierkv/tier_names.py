"""The names of the tiers, from the fastest to the slowest."""

from __future__ import annotations

__all__ = ["COLD", "DEVICE", "DISK", "HOST", "REMOTE", "TIERS"]

DEVICE, HOST, COLD = "device", "host", "cold"
TIERS = (DEVICE, HOST, COLD)  # the tiers of the tier core (TierSet)
DISK = "disk"  # a plug-in tier below the host (tierkv.tier, tierkv.disk.tier)
REMOTE = "remote"  # page sources: a peer's page server, a cluster, Redis (tierkv.remote_tier)
