"""Counters of a store (the transfer figures live in :class:`tierkv.tiers.TierStats`)."""

from __future__ import annotations

from dataclasses import dataclass


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
