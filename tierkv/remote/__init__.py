"""The remote tier: a store's host tier served to peers, and read or written from them.

::

    prefill process                                   decode process
    KVStore ── host arena ──┐                         KVStore ── host arena
    PageServer ─────────────┤ control: lookup,        RemoteTier.load(keys, arena, slots)
      Directory: slot, gen  │ acquire, release ...    import_prefix(store, peer, prompt)
                            └ data: shm / tcp  <────  one-sided reads (writes: publish)

`PageServer` exposes an opened store (`tierkv serve`, tierkv/cli/serve.py, runs one);
`RemoteTier` is its client; `import_prefix` / `publish_prefix` move a prompt's cached blocks to
and from any `PageSource`, `RedisTier` (Redis / Valkey, docs/redis.md) included. See
docs/remote.md. The package is split by role, imports running one way (no side imports the
other's modules)::

    sources/    the clients of a PageSource (RemoteTier, RemoteCluster, Watch, RedisTier)
    server/     PageServer, its admission, directory (leases), watches, hosting
    membership/ the cluster directory in Redis / Valkey: who is live, who holds which page
    protocol/   what both sides speak: messages and limits, the Control connection, secrets
    errors.py   the RemoteError tree;  store_io.py: prefix helpers over any PageSource

The store's own glue (the `PageSource` protocol, `StoreRemote`, `Pusher`) lives in the core
(tierkv/page_source.py, remote_tier.py, push.py): the store never imports this package.

    sources ──> protocol <── server        (both ──> errors, tierkv.transports)
         └──> membership <──┘
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierkv.page_source import PageSource
from tierkv.remote.errors import (
    PeerGoneError,
    RemoteError,
    RemoteFullError,
    RemoteProtocolError,
    RemoteRefusedError,
    RemoteTimeoutError,
    TenantRefusedError,
)
from tierkv.remote.server.directory import Directory
from tierkv.remote.server.hosting import share_host_arena
from tierkv.remote.server.page_server import PageServer
from tierkv.remote.sources.client import ReadLease, RemoteTier
from tierkv.remote.sources.cluster import RemoteCluster
from tierkv.remote.sources.watch import Watch
from tierkv.remote.store_io import import_prefix, prefix_pages, publish_prefix, stage_prefix
from tierkv.remote_tier import RemoteCounters, StoreRemote

if TYPE_CHECKING:
    from tierkv.remote.sources.redis_tier import RedisTier

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
    "TenantRefusedError",
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
        from tierkv.remote.sources.redis_tier import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
