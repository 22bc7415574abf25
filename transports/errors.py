"""The transports' error tree, drawn once.

Every error a transport raises on purpose derives from `TransportError`; lower-level failures
(an `OSError` from a socket, a `msgpack` decode error) are mapped at the boundary with
``raise ... from exc``.

The root of every error the whole library raises, `TierKVError`, is defined here, in the lowest
layer, so that the runtime's and the transports' trees hang under it too (imports run
tierkv -> runtime -> transports); ``tierkv.errors`` re-exports it. So are `UnknownNameError`, what
every registry (transports, backends, eviction policies, codecs) raises for a name it does not
know, and `InvalidInputError` / `InvalidTypeError`, what every layer raises for a bad argument::

    TierKVError
    ├── UnknownNameError (also LookupError)   no factory of that name in a registry
    │   └── UnknownTransportError (also a TransportError)
    ├── InvalidInputError (also ValueError)  a bad argument, rejected at entry: nothing changed
    │   └── InvalidTypeError (also TypeError) an argument of the wrong type
    └── TransportError
        ├── RegionError           register/deregister misuse, a bad local region or local range
        ├── PeerError             unknown peer, bad metadata, peer unreachable or gone mid-transfer
        │   └── AuthError         the shared-secret handshake failed (either side)
        ├── ProtocolError         a malformed, oversized or unexpected frame
        │   └── ChecksumError     a payload's checksum does not match its header
        ├── RemoteAccessError     the target refused: unknown region, out of bounds, not shareable
        ├── TransferTimeoutError  a bounded wait ran out (also a `TimeoutError`)
        ├── ClosedError           use of a transport after `aclose()`
        └── UnknownTransportError `create` of a name no registry entry has
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "ChecksumError",
    "ClosedError",
    "InvalidInputError",
    "InvalidTypeError",
    "PeerError",
    "ProtocolError",
    "RegionError",
    "RemoteAccessError",
    "TierKVError",
    "TransferTimeoutError",
    "TransportError",
    "UnknownNameError",
    "UnknownTransportError",
]


class TierKVError(Exception):
    """Root of every error raised by the library: ``tierkv``, its runtime and its transports."""


class UnknownNameError(TierKVError, LookupError):
    """A registry has no factory of that name (a transport, backend, eviction policy or codec).

    Each registry's own error derives from this one and keeps its older base for compatibility
    (a codec's is also a ``KeyError``, a policy's a ``ValueError``)."""

    def __str__(self) -> str:  # a KeyError subclass would quote its argument
        return str(self.args[0]) if self.args else "unknown name"


class InvalidInputError(TierKVError, ValueError):
    """A bad argument to a public call, rejected at entry before anything changed."""


class InvalidTypeError(InvalidInputError, TypeError):
    """An argument of the wrong type (also a ``TypeError``)."""


class TransportError(TierKVError):
    """Root of every error raised by `transports`."""


class RegionError(TransportError):
    """Misuse of registered memory: a bad buffer or kind, an unknown region, a local range
    outside its region. Nothing is changed when this is raised."""


class PeerError(TransportError):
    """A peer is unknown, its metadata is bad, or it cannot be reached (or vanished)."""


class AuthError(PeerError):
    """The shared-secret handshake with a peer failed."""


class ProtocolError(TransportError):
    """A frame was malformed, oversized or unexpected; the connection is dropped."""


class ChecksumError(ProtocolError):
    """A payload's checksum did not match the one its header announced."""


class RemoteAccessError(TransportError):
    """The target refused an access: unknown region, out of bounds, or not remotely accessible."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A bounded wait (transfer, notification, connect, handshake) ran out of time."""


class ClosedError(TransportError):
    """The transport has been closed."""


class UnknownTransportError(TransportError, UnknownNameError):
    """No transport is registered (or declared by an entry point) under that name."""
