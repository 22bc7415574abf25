"""The names of the tiers, from the fastest to the slowest."""

from __future__ import annotations

__all__ = ["COLD", "DEVICE", "HOST", "TIERS"]

DEVICE, HOST, COLD = "device", "host", "cold"
TIERS = (DEVICE, HOST, COLD)
