"""The page server's control protocol: small msgpack messages over one stream connection.

Pages never travel here; they move one-sidedly through a transport (shm, tcp, ...). A frame is
``u32 length | msgpack map``. Every request carries ``op`` and ``id``; the reply echoes ``id``
and carries either the fields below or ``err`` (a code) and ``msg``::

    server -> client  {"nonce"}                                      on connect
    hello    {"mac"}                     -> {"name", "spec", "lease_ttl", "transports":
                                                {kind: {"metadata", "region"}}}
    lookup   {"keys"}                    -> {"n"}               readable prefix in the host tier
    acquire  {"keys"}                    -> {"lease", "slots", "gens"}   pins that prefix
    release  {"lease"}                   -> {"valid"}    pages whose slot and generation held
    reserve  {"keys"}                    -> {"lease", "slots"}   host slots to write (-1: skip)
    commit   {"lease", "ok"}             -> {"stored"}
    stats    {}                          -> {"pages", "leases", "peers", "watchers", ...}
    locate   {"keys"}                    -> {"nodes"}   a node address per leading page held
    watch    {"keys"}                    -> {"held"}    per key: held now (then watched)
    unwatch  {"keys"}                    -> {}
    hold     {"node", "full", "add", "drop"} -> {"peers"}   a peer's holdings (gossip.py)

    server -> client, unasked, on a connection that watches:
             {"ev": "gone", "keys"}      watched pages that left the host tier

``mac`` is ``HMAC-SHA256(secret, b"tierkv-page-server" + nonce)`` (empty secret: no auth).
Error codes: ``auth``, ``spec``, ``full``, ``bad`` (malformed request), ``op`` (unknown op).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from typing import Any

import msgpack

from tierkv.remote.errors import (
    RemoteError,
    RemoteFullError,
    RemoteProtocolError,
    RemoteRefusedError,
)

__all__ = ["MAX_FRAME", "MAX_KEYS", "auth_mac", "error_for", "keys_of", "recv", "send"]

MAX_FRAME = 8 << 20
MAX_KEYS = 1 << 18
_LEN = struct.Struct("!I")


async def send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    """Write one frame and drain. Raises ConnectionError when the peer is gone."""
    body = msgpack.packb(obj, use_bin_type=True)
    writer.write(_LEN.pack(len(body)) + body)
    await writer.drain()


async def recv(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame, or None at EOF. Raises RemoteProtocolError on a bad frame."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(4))
        if n > MAX_FRAME:
            raise RemoteProtocolError(f"control frame of {n} bytes (limit {MAX_FRAME})")
        body = await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    try:
        obj = msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError("malformed control frame") from exc
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"control frame is a {type(obj).__name__}, not a map")
    return obj


def auth_mac(secret: bytes, nonce: bytes) -> bytes:
    """The proof a client sends in its hello."""
    return hmac.new(secret, b"tierkv-page-server" + nonce, hashlib.sha256).digest()


def keys_of(msg: dict[str, Any]) -> list[bytes]:
    """The ``keys`` field as a list of bytes. Raises RemoteProtocolError."""
    keys = msg.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise RemoteProtocolError(f"keys must be a list of at most {MAX_KEYS} byte strings")
    if not all(isinstance(k, bytes) and 0 < len(k) <= 64 for k in keys):
        raise RemoteProtocolError("every key must be 1 to 64 bytes")
    return keys


def error_for(reply: dict[str, Any]) -> RemoteError:
    """The typed error an ``err`` reply stands for."""
    code, msg = reply.get("err"), str(reply.get("msg", ""))
    if code == "full":
        return RemoteFullError(msg)
    if code in ("auth", "spec", "op"):
        return RemoteRefusedError(f"{code}: {msg}")
    return RemoteProtocolError(f"{code}: {msg}")
