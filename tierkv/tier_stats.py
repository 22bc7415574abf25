"""Names and counters shared by the tier modules."""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE, HOST, COLD = "device", "host", "cold"
Key = bytes


@dataclass(slots=True)
class TierStats:
    """Counters of a :class:`~tierkv.tiers.TierSet` (monotonic but ``peak_device_pages``)."""

    loads_from: dict[str, int] = field(default_factory=lambda: {HOST: 0, COLD: 0})
    pages_written_back: int = 0
    pages_compressed: int = 0
    pages_dropped: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    copy_s: float = 0.0
    decode_s: float = 0.0
    encode_s: float = 0.0
    peak_device_pages: int = 0
