"""The store's glue to a remote tier, re-exported: it lives in the core (:mod:`tierkv.remote_tier`),
which knows a remote tier only by the `PageSource` protocol, so that the store imports it
directly and this package depends on the store one way only."""

from __future__ import annotations

from tierkv.remote_tier import RemoteCounters, StoreRemote

__all__ = ["RemoteCounters", "StoreRemote"]
