"""The page server's control protocol: small msgpack messages over one stream connection.

Pages never travel here; they move one-sidedly through a transport (shm, tcp, ...). Framing,
the mutual handshake and the per-frame tags are `transports.session` (one stack for every
control channel); this module holds the page server's messages and their limits. After the
handshake (challenge -> auth -> welcome, both sides proving the secret over the transcript)
every frame is ``u32 length | msgpack map | tag16``. Every request carries ``op`` and ``id``;
the reply echoes ``id`` and carries either the fields below or ``err`` (a code) and ``msg``::

    hello    {}                          -> {"name", "spec", "lease_ttl", "transports":
                                                {kind: {"metadata", "region"}}}
    lookup   {"keys"}                    -> {"n"}               readable prefix in the host tier
    acquire  {"keys"}                    -> {"lease", "slots", "gens", "sums"}   pins that prefix
    release  {"lease"}                   -> {"valid"}    pages whose slot and generation held
    reserve  {"keys", "sums", "agent"?}  -> {"lease", "slots"}   host slots to write (-1: skip);
                                             only the transport agent named may write them
    commit   {"lease", "ok"}             -> {"stored", "corrupt"}   err "expired": the lease
                                             ended first
    stats    {}                          -> {"pages", "leases", "peers", "watchers", ...}
    locate   {"keys"}                    -> {"nodes"}   our address per leading page we hold
    watch    {"keys"}                    -> {"held"}    per key: held now (then watched)
    unwatch  {"keys"}                    -> {}

    server -> client, unasked, on a connection that watches:
             {"ev": "gone", "keys"}      watched pages that left the host tier

Page checksums (``sums``: one CRC-32C of the raw page per key, an int in [0, 2**32); the
hello's ``"checks": "crc32c"`` says a server keeps them): a reader checks what it read against
``acquire``'s; a writer declares its pages' at ``reserve``, and ``commit`` stores only the pages
whose bytes match, counting the rest (``corrupt``). A page without a checksum (a request
without ``sums``, a ``-1``) is corrupt; so is, for a reader, every page of a server whose
``acquire`` answers without them.

Roles in the handshake: the server is a ``page-server`` (its id: its address); a client is a
``client`` (RemoteTier, Watch) or a ``page-server`` (its id: its address).
Error codes: ``auth``, ``spec``, ``full``, ``expired`` (a write lease that ended before its
commit), ``bad`` (malformed request), ``op`` (unknown op).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from tierkv.remote.errors import (
    LeaseExpiredError,
    RemoteError,
    RemoteFullError,
    RemoteProtocolError,
    RemoteRefusedError,
)
from tierkv.transports.session import Limits

if TYPE_CHECKING:
    from tierkv.spec import KVSpec

__all__ = [
    "CLIENT",
    "MAX_FRAME",
    "MAX_KEYS",
    "MAX_LEASE_TTL",
    "PAGE_SERVER",
    "REPLY_LIMITS",
    "REQUEST_LIMITS",
    "error_for",
    "keys_of",
    "lease_ttl_of",
    "spec_fields",
    "sums_of",
]

MAX_FRAME = 8 << 20
MAX_KEYS = 1 << 18
PAGE_SERVER, CLIENT = "page-server", "client"
MAX_LEASE_TTL = 86400.0
"""The longest lease a page server may grant (s; its hello's ``lease_ttl`` is in (0, this])."""
#: what a server decodes from an authenticated peer: flat lists of short keys, short strings
REQUEST_LIMITS = Limits(frame=MAX_FRAME, array=MAX_KEYS, map=16, str=1024, bin=64)
#: what a client decodes from a server (the hello carries transport metadata)
REPLY_LIMITS = Limits(frame=MAX_FRAME, array=MAX_KEYS, map=64, str=1 << 16, bin=1 << 20)


def spec_fields(spec: KVSpec) -> dict[str, Any]:
    """The page layout a peer must share to use our pages (the hello's ``spec``; RedisTier
    hashes it into every value's header)."""
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(spec.dtype),
        "page_tokens": spec.page_tokens,
        "page_bytes": spec.page_bytes,
    }


def keys_of(msg: dict[str, Any]) -> list[bytes]:
    """The ``keys`` field as a list of bytes. Raises RemoteProtocolError."""
    keys = msg.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise RemoteProtocolError(f"keys must be a list of at most {MAX_KEYS} byte strings")
    if not all(isinstance(k, bytes) and 0 < len(k) <= 64 for k in keys):
        raise RemoteProtocolError("every key must be 1 to 64 bytes")
    return keys


def sums_of(msg: dict[str, Any], n: int) -> list[int] | None:
    """The ``sums`` field: ``n`` checksums, each an int in [0, 2**32) or -1 (none); None when
    the field is absent. Raises RemoteProtocolError for anything else."""
    sums = msg.get("sums")
    if sums is None:
        return None
    if not isinstance(sums, list) or len(sums) != n:
        raise RemoteProtocolError(f"sums must be a list of {n} checksums")
    if not all(type(c) is int and -1 <= c < 1 << 32 for c in sums):
        raise RemoteProtocolError("every checksum must be an int in [-1, 2**32)")
    return sums


def lease_ttl_of(hello: dict[str, Any]) -> float:
    """The hello's ``lease_ttl``: a finite number of seconds in (0, MAX_LEASE_TTL] (absent: 0,
    an old server's). Raises RemoteProtocolError for anything else (NaN, inf, a negative or
    huge number, a bool, a string): a hostile server's value is never taken."""
    ttl = hello.get("lease_ttl", 0.0)
    if not isinstance(ttl, int | float) or isinstance(ttl, bool):
        raise RemoteProtocolError(f"lease_ttl {ttl!r:.40} in the hello is not a number")
    try:
        value = float(ttl)
    except OverflowError:  # an int past a float's range
        value = math.inf
    if "lease_ttl" in hello and not 0 < value <= MAX_LEASE_TTL:  # (NaN too)
        raise RemoteProtocolError(
            f"lease_ttl {ttl!r:.40} in the hello is outside (0, {MAX_LEASE_TTL:g}] seconds"
        )
    return value


def int_of(msg: dict[str, Any], name: str) -> int:
    """The integer field ``name``. Raises RemoteProtocolError."""
    value = msg.get(name)
    if type(value) is not int:
        raise RemoteProtocolError(f"{name} must be an integer")
    return value


def agent_of(msg: dict[str, Any]) -> str | None:
    """The optional ``agent`` field (the writer's transport agent). Raises
    RemoteProtocolError."""
    agent = msg.get("agent")
    if agent is not None and not isinstance(agent, str):
        raise RemoteProtocolError("agent must be a string")
    return agent


def error_for(reply: dict[str, Any]) -> RemoteError:
    """The typed error an ``err`` reply stands for."""
    code, msg = reply.get("err"), str(reply.get("msg", ""))
    if code == "full":
        return RemoteFullError(msg)
    if code == "expired":
        return LeaseExpiredError(msg)
    if code in ("auth", "spec", "op"):
        return RemoteRefusedError(f"{code}: {msg}")
    return RemoteProtocolError(f"{code}: {msg}")
