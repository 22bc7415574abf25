"""tierkv transports: bytes across processes and nodes (registered regions, peers, one-sided ops).

This package knows registered memory regions and peers, never tiers or KV pages::

    import tierkv.transports as transports

    async with transports.create("shm") as t:
        region = t.allocate(1 << 20)
        peer = await t.add_peer(other_metadata)
        await t.read([transports.TransferOp(region, 0, remote_desc, 0, 4096)])

Backends: "loopback" (same process), "shm" (same host), "tcp" (across hosts), "nixl" (NIXL/UCX,
needs nixl-cu12); more through
`register()` or the `tierkv.transports` entry-point group (see docs/transports.md).
"""

from __future__ import annotations

from .base import DEFAULT_TIMEOUT_S, Transport
from .errors import (
    AuthError,
    ChecksumError,
    ClosedError,
    PeerError,
    ProtocolError,
    RegionError,
    RemoteAccessError,
    TransferTimeoutError,
    TransportError,
)
from .handle import BatchHandle
from .regions import (
    Capabilities,
    Notification,
    Region,
    RegionDescriptor,
    TransferOp,
    group_by_peer,
)
from .registry import ENTRY_POINT_GROUP, available, create, register, unregister

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENTRY_POINT_GROUP",
    "AuthError",
    "BatchHandle",
    "Capabilities",
    "ChecksumError",
    "ClosedError",
    "Notification",
    "PeerError",
    "ProtocolError",
    "Region",
    "RegionDescriptor",
    "RegionError",
    "RemoteAccessError",
    "TransferOp",
    "TransferTimeoutError",
    "Transport",
    "TransportError",
    "available",
    "create",
    "group_by_peer",
    "register",
    "unregister",
]
