"""Who may be served, and where a page server may dial: the secret it serves with and the
address checks behind its secure defaults (docs/security.md)::

    resolve_secret(None)            $TIERKV_TRANSPORT_SECRET, else ValueError (none, or empty)
    resolve_secret(None, insecure=True) -> b""      (then only on loopback: is_loopback(host))
    same_host("10.0.0.8", "10.0.0.8")  a node announcing itself from its own address
"""

from __future__ import annotations

import ipaddress
import logging
import os

from tierkv.errors import InvalidInputError, InvalidTypeError

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "is_loopback",
    "resolve_secret",
    "same_host",
    "warn_if_short",
]

SECRET_ENV = "TIERKV_TRANSPORT_SECRET"
MIN_SECRET_BYTES = 16
"""Secrets shorter than this are taken, with a warning."""

log = logging.getLogger(__name__)


def resolve_secret(secret: bytes | None, *, insecure: bool = False) -> bytes:
    """The secret to use: ``secret``, else ``$TIERKV_TRANSPORT_SECRET``. Raises ValueError for
    an empty secret, or for none at all unless ``insecure`` (then b"": anyone may connect);
    InvalidTypeError for a secret that is not bytes."""
    if secret is None:
        env = os.environ.get(SECRET_ENV)
        secret = env.encode() if env is not None else None
    elif isinstance(secret, bytearray | memoryview):
        secret = bytes(secret)
    elif not isinstance(secret, bytes):  # (a str secret failed at the first handshake)
        raise InvalidTypeError(f"a secret is bytes, got {type(secret).__name__}")
    if secret is not None and not secret:
        raise InvalidInputError(f"an empty secret is not a secret (secret= or ${SECRET_ENV})")
    if secret is None:
        if not insecure:
            raise InvalidInputError(
                f"no shared secret (secret= or ${SECRET_ENV}); insecure=True to serve without"
            )
        return b""
    warn_if_short(secret, "the shared secret")
    return secret


def warn_if_short(secret: bytes, what: str) -> None:
    """Log a warning for a secret under :data:`MIN_SECRET_BYTES` (a peer could guess it: the
    handshake bounds attempts per connection, not connections)."""
    if len(secret) < MIN_SECRET_BYTES:
        log.warning(
            "%s has %d bytes: a peer could guess it; use at least %d random bytes "
            "(for example `openssl rand -hex 32`)",
            what,
            len(secret),
            MIN_SECRET_BYTES,
        )


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP literal or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def same_host(host: str, addr: str) -> bool:
    """True when ``host`` (a node's announced host) is the address ``addr`` a connection
    comes from (any two loopback addresses count as one host)."""
    if host == addr:
        return True
    return is_loopback(host) and is_loopback(addr)
