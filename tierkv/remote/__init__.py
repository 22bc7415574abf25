"""The remote tier: a store's host tier served to peers, and read or written from them.

::

    prefill process                                   decode process
    KVStore ── host arena ──┐                         KVStore ── host arena
    PageServer (serve.py) ──┤ control: lookup,        RemoteTier.load(keys, arena, slots)
      Directory: slot, gen  │ acquire, release ...    import_prefix(store, peer, prompt)
                            └ data: shm / tcp  <────  one-sided reads (writes: publish)

`PageServer` exposes an opened store (`tierkv serve` runs one); `RemoteTier` is its client;
`import_prefix` / `publish_prefix` move a prompt's cached blocks to and from any `PageSource`,
`RedisTier` (Redis / Valkey, docs/redis.md) included. See docs/remote.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierkv.remote.client import ReadLease, RemoteTier
from tierkv.remote.cluster import RemoteCluster
from tierkv.remote.directory import Directory
from tierkv.remote.errors import (
    PeerGoneError,
    RemoteError,
    RemoteFullError,
    RemoteProtocolError,
    RemoteRefusedError,
    RemoteTimeoutError,
)
from tierkv.remote.hosting import share_host_arena
from tierkv.remote.link import RemoteCounters, StoreRemote
from tierkv.remote.server import PageServer
from tierkv.remote.source import PageSource
from tierkv.remote.store_io import import_prefix, prefix_pages, publish_prefix, stage_prefix
from tierkv.remote.watch import Watch

if TYPE_CHECKING:
    from tierkv.remote.redis_tier import RedisTier

__all__ = [
    "Directory",
    "PageServer",
    "PageSource",
    "PeerGoneError",
    "ReadLease",
    "RedisTier",
    "RemoteCluster",
    "RemoteCounters",
    "RemoteError",
    "RemoteFullError",
    "RemoteProtocolError",
    "RemoteRefusedError",
    "RemoteTier",
    "RemoteTimeoutError",
    "StoreRemote",
    "Watch",
    "import_prefix",
    "prefix_pages",
    "publish_prefix",
    "share_host_arena",
    "stage_prefix",
]


def __getattr__(name: str) -> Any:
    """`RedisTier` is imported on first use: it needs the ``redis`` extra (redis, xxhash)."""
    if name == "RedisTier":
        from tierkv.remote.redis_tier import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
