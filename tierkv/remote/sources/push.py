"""`Pusher`, re-exported from the core (:mod:`tierkv.push`): pages leaving a store's host tier,
staged and published to a `PageSource` in batches. It is part of the store's glue to a remote
tier (:mod:`tierkv.remote_tier`), which the store imports without importing this package."""

from __future__ import annotations

from tierkv.push import PushCounters, Pusher

__all__ = ["PushCounters", "Pusher"]
