"""Counters: a store's (:class:`StoreCounters`) and its tiers' transfers (:class:`TierStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.tier_names import COLD, HOST


@dataclass(slots=True)
class StoreCounters:
    """Monotonic counters kept by :class:`tierkv.store.KVStore`."""

    pages_leased: int = 0
    device_hits: int = 0
    late_fetches: int = 0
    prefetched: int = 0
    prefetch_used: int = 0
    prefetch_skipped: int = 0
    idle_compressed: int = 0
    prefix_tokens_reused: int = 0
    prompt_tokens: int = 0
    background_errors: int = 0
    last_error: str = ""


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
    # time.perf_counter() when the copies of the last device load to complete had all ended
    # (their own end, not when the loop next ran): a step tells a late fetch by it
    loads_landed_at: float = 0.0
    # pages whose bytes failed their checksum, by where they were read from (``cold``,
    # ``peer``, ``redis``): each a miss, the page dropped
    corrupt: dict[str, int] = field(default_factory=dict)
