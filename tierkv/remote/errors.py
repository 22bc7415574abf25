"""The remote tier's errors, drawn once.

::

    RemoteError (a TierKVError)
    ├── PeerGoneError             the page server vanished or cannot be reached (mid-call too)
    ├── RemoteTimeoutError        a bounded wait on the page server ran out (also TimeoutError)
    ├── RemoteProtocolError       a malformed or unexpected control message
    ├── LeaseExpiredError         a write lease ended before its commit: nothing was stored
    ├── RemoteRefusedError        the server said no: bad auth, spec mismatch, unknown op
    │    ├── RemoteFullError      no room in the server's host tier (everything pinned)
    │    └── TenantRefusedError   our tenant was refused: unknown to the server, or not the
    │                             tenant of our secret (the server does not say which)
    └── DirectoryError            the cluster directory (Redis / Valkey) cannot be used
         ├── DirectoryURLError    a directory URL or option that does not parse (also a
         │                        ValueError, an InvalidInputError)
         ├── DirectoryAuthError   the directory's Redis refused our credentials
         └── NodeIdTakenError     another live node holds our node id (its address)

Transport errors (`transports.TransportError`) are mapped at the boundary with
``raise ... from exc``: `PeerError` -> PeerGoneError, `TransferTimeoutError` ->
RemoteTimeoutError, anything else -> RemoteError.
"""

from __future__ import annotations

import tierkv.transports as transports
from tierkv.boundary import register_transport_mapper
from tierkv.errors import InvalidInputError, TierKVError

__all__ = [
    "DirectoryAuthError",
    "DirectoryError",
    "DirectoryURLError",
    "LeaseExpiredError",
    "NodeIdTakenError",
    "PeerGoneError",
    "RemoteError",
    "RemoteFullError",
    "RemoteProtocolError",
    "RemoteRefusedError",
    "RemoteTimeoutError",
    "TenantRefusedError",
    "map_transport_error",
]


class RemoteError(TierKVError):
    """Root of the remote tier's errors. Local pages are left as they were when it is raised."""


class PeerGoneError(RemoteError):
    """The page server is unreachable, or vanished while a call was in flight."""


class RemoteTimeoutError(RemoteError, TimeoutError):
    """A bounded wait on the page server (control reply or one-sided transfer) ran out."""


class RemoteProtocolError(RemoteError):
    """A malformed, oversized or unexpected control message."""


class LeaseExpiredError(RemoteError):
    """A write lease expired (its ttl ran out, or its connection closed) before the writer
    committed it: the pages were not stored, and the slots it wrote are quarantined until the
    server knows the write has ended (this commit tells it). Publish the pages again."""


class RemoteRefusedError(RemoteError):
    """The page server refused a request (authentication, page layout, unknown operation)."""


class RemoteFullError(RemoteRefusedError):
    """The page server's host tier has no room for the pages to publish."""


class TenantRefusedError(RemoteRefusedError):
    """The page server refused the tenant we named at connect: it has no such tenant, or our
    secret is not that tenant's. It answers both alike, so that a peer learns no tenant's
    name from it."""


class DirectoryError(RemoteError):
    """The cluster directory (tierkv.remote.membership) cannot be used as configured. Raised at
    start only: once running, a directory that fails answers "not known" and is retried."""


class DirectoryURLError(DirectoryError, InvalidInputError):
    """A directory URL (``redis://``, ``rediss://``, with or without a password) or option that
    does not parse."""


class DirectoryAuthError(DirectoryError):
    """The directory's Redis / Valkey refused our credentials (wrong or missing password)."""


class NodeIdTakenError(DirectoryError):
    """Another live node holds the node id (the address) we register under; a node that died
    lets go of it within its ttl."""


def map_transport_error(exc: transports.TransportError, what: str) -> RemoteError:
    """The remote error that stands for a transport error raised while doing `what`."""
    if isinstance(exc, transports.PeerError):
        return PeerGoneError(f"{what}: {exc}")
    if isinstance(exc, transports.TransferTimeoutError):
        return RemoteTimeoutError(f"{what}: {exc}")
    return RemoteError(f"{what}: {type(exc).__name__}: {exc}")


# the store's error boundary maps transport errors with this (it never imports this package)
register_transport_mapper(lambda exc: map_transport_error(exc, "the remote tier"))
