"""One authentication and framing stack for every control channel: the page server's control
socket, the shm transport's control socket and the tcp transport's frame headers.

Mutual authentication bound to the session (both sides prove the shared secret over the whole
transcript, then every frame carries a tag under a per-connection, per-direction key)::

    server                                        client
      challenge {op, v, role, id, nonce_s}  ──────>          (plain frame, <= HELLO_MAX bytes)
                                            <──────  auth {op, v, role, id, nonce_c, mac, ...}
      welcome {op, mac, ...}                ──────>          (plain frame)
      ... every later frame: body | tag16   <─────>  tag16 = HMAC-SHA256(key_dir, seq || body)[:16]

    T          = "tierkv-session-v3" | nonce_s | nonce_c | role_s | id_s | role_c | id_c
                 (each part length-prefixed, so no two transcripts collide)
    client mac = HMAC-SHA256(secret, "client proof" | T)
    server mac = HMAC-SHA256(secret, "server proof" | T)
    keys       = HKDF-SHA256(secret, salt = SHA256(T)) -> key_c2s, key_s2c

Both nonces are fresh, so a recorded handshake replayed on a new connection fails; a party
without the secret that relays a handshake ends up between two peers whose keys it does not
know, and the first frame it injects fails its tag. Sequence numbers are implicit (each side
counts the frames of each direction), so a replayed, dropped or reordered frame fails too.

Payloads of data frames (tcp) are not tagged: they keep their CRC32C, which the tagged header
carries. Nothing is encrypted (see docs/security.md; use TLS on untrusted networks).

Every msgpack decode of a peer's bytes goes through `decode` (or `unpack`, a map) with explicit
`Limits`: frames here, peer metadata (`base.METADATA_LIMITS`) and region descriptors
(`regions.DESCRIPTOR_LIMITS`) alike; before authentication only `HELLO_LIMITS` apply (a frame
of at most HELLO_MAX bytes, read within a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import AuthError, ProtocolError, TransferTimeoutError

__all__ = [
    "HELLO_LIMITS",
    "HELLO_MAX",
    "PROTOCOL",
    "TAG_BYTES",
    "Limits",
    "Seal",
    "SecretOf",
    "SessionKeys",
    "StreamSession",
    "decode",
    "proof",
    "session_keys",
    "transcript",
    "unpack",
]

PROTOCOL = b"tierkv-session-v3"
VERSION = 3
PREFIX = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
TAG_BYTES = 16
NONCE_BYTES = 16
HELLO_MAX = 4096  # the largest frame accepted before authentication
HELLO_DEADLINE = 5.0  # seconds a peer has to complete the handshake


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds of one msgpack frame: its bytes, and the longest array, map, str and bin in it
    (msgpack's own nesting limit bounds depth)."""

    frame: int
    array: int
    map: int
    str: int
    bin: int


HELLO_LIMITS = Limits(frame=HELLO_MAX, array=16, map=16, str=256, bin=64)

#: a server's choice of secret from a client's auth frame (its ``tenant`` field, say); None
#: for a client it does not know (refused like a bad proof)
SecretOf = Callable[[dict[str, Any]], bytes | None]
#: what a refused client's proof is checked against, so that refusing costs what checking does
_NO_SECRET = secrets.token_bytes(32)


def decode(data: bytes | memoryview, limits: Limits) -> Any:
    """Decode msgpack ``data`` within ``limits`` (its size first, then every array, map, str and
    bin length; no ext types). Raises ProtocolError."""
    if len(data) > limits.frame:
        raise ProtocolError(f"frame of {len(data)} bytes (limit {limits.frame})")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            max_array_len=limits.array,
            max_map_len=limits.map,
            max_str_len=limits.str,
            max_bin_len=limits.bin,
            max_ext_len=0,
        )
    except Exception as exc:  # every decoder failure (format, limits, nesting, utf-8, keys)
        raise ProtocolError(f"malformed frame: {type(exc).__name__}") from exc


def unpack(body: bytes | memoryview, limits: Limits) -> dict[str, Any]:
    """Decode one frame body as a msgpack map within ``limits``. Raises ProtocolError."""
    obj = decode(body, limits)
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame is a {type(obj).__name__}, not a map")
    return obj


def _parts(label: bytes, *parts: bytes) -> bytes:
    return label + b"".join(PREFIX.pack(len(p)) + p for p in parts)


def transcript(
    server_nonce: bytes,
    client_nonce: bytes,
    server_role: str,
    server_id: str,
    client_role: str,
    client_id: str,
) -> bytes:
    """The handshake transcript both proofs and the session keys are bound to."""
    return _parts(
        PROTOCOL,
        server_nonce,
        client_nonce,
        server_role.encode(),
        server_id.encode(),
        client_role.encode(),
        client_id.encode(),
    )


def proof(secret: bytes, side: str, transcript_: bytes) -> bytes:
    """The MAC ``side`` ("client" or "server") sends to prove it holds ``secret``."""
    return hmac.new(secret, side.encode() + b" proof" + transcript_, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The per-connection keys of one session, one per direction."""

    client_to_server: bytes
    server_to_client: bytes


def session_keys(secret: bytes, transcript_: bytes) -> SessionKeys:
    """HKDF-SHA256 (extract with the transcript's hash as salt, then expand) of ``secret``."""
    prk = hmac.new(hashlib.sha256(transcript_).digest(), secret, hashlib.sha256).digest()
    c2s = hmac.new(prk, b"c2s" + b"\x01", hashlib.sha256).digest()
    s2c = hmac.new(prk, b"s2c" + b"\x01", hashlib.sha256).digest()
    return SessionKeys(c2s, s2c)


class Seal:
    """Tags of one direction of a session: HMAC-SHA256(key, seq || frame)[:16], seq counting
    the frames of that direction from 0."""

    __slots__ = ("_base", "seq")

    def __init__(self, key: bytes) -> None:
        self._base = hmac.new(key, digestmod=hashlib.sha256)
        self.seq = 0

    def tag(self, *pieces: bytes | memoryview) -> bytes:
        """The tag of the next frame (whose bytes are ``pieces``, in order)."""
        m = self._base.copy()
        m.update(_SEQ.pack(self.seq))
        for p in pieces:
            m.update(p)
        self.seq += 1
        return m.digest()[:TAG_BYTES]

    def check(self, body: bytes | memoryview, tag: bytes | memoryview) -> None:
        """Verify the next frame's tag. Raises AuthError (the session is broken then)."""
        if not hmac.compare_digest(self.tag(body), bytes(tag)):
            raise AuthError(f"frame {self.seq - 1} fails its tag (forged, replayed or reordered)")


def seals(keys: SessionKeys, server: bool) -> tuple[Seal, Seal]:
    """(send, receive) seals of one side of a session."""
    c2s, s2c = Seal(keys.client_to_server), Seal(keys.server_to_client)
    return (s2c, c2s) if server else (c2s, s2c)


class StreamSession:
    """A control stream over asyncio streams: ``u32 length | msgpack map [| tag16]``.

    Frames are plain until the handshake (`serve_handshake` / `client_handshake`) completes,
    then tagged. `send` writes a whole frame in one synchronous step (so concurrent senders
    never interleave and a cancelled `send` leaves no half frame); only the drain awaits.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limits: Limits
    ) -> None:
        self.reader, self.writer, self.limits = reader, writer, limits
        self._tx: Seal | None = None
        self._rx: Seal | None = None
        self.peer_role = ""
        self.peer_id = ""
        self.frames_in = 0

    @property
    def authenticated(self) -> bool:
        """True once the handshake completed (every frame is tagged from then on)."""
        return self._rx is not None

    def write(self, obj: dict[str, Any]) -> int:
        """Queue one frame without waiting; returns the bytes queued."""
        body = msgpack.packb(obj, use_bin_type=True)
        tag = self._tx.tag(body) if self._tx is not None else b""
        self.writer.write(PREFIX.pack(len(body) + len(tag)) + body + tag)
        return len(body) + len(tag) + 4

    async def send(self, obj: dict[str, Any]) -> None:
        """Write one frame and drain. Raises ConnectionError when the peer is gone."""
        self.write(obj)
        await self.writer.drain()

    async def recv(self, limits: Limits | None = None) -> dict[str, Any] | None:
        """The next frame, or None at EOF. Raises ProtocolError (bad or oversized frame) or
        AuthError (a tag that fails)."""
        lim = limits or (self.limits if self._rx is not None else HELLO_LIMITS)
        extra = TAG_BYTES if self._rx is not None else 0
        try:
            (n,) = PREFIX.unpack(await self.reader.readexactly(4))
            if not extra <= n <= lim.frame + extra:
                raise ProtocolError(f"frame of {n} bytes (limit {lim.frame})")
            raw = await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        body = memoryview(raw)[: n - extra]
        if self._rx is not None:
            self._rx.check(body, memoryview(raw)[n - extra :])
        self.frames_in += 1
        return unpack(body, lim)

    async def _recv_hello(self, deadline: float, what: str) -> dict[str, Any]:
        try:
            msg = await asyncio.wait_for(self.recv(HELLO_LIMITS), deadline)
        except TimeoutError as exc:
            raise TransferTimeoutError(f"no {what} within {deadline:g} s") from exc
        if msg is None:
            raise ConnectionResetError(f"the peer left before its {what}")
        return msg

    async def serve_handshake(
        self,
        secret: bytes | SecretOf,
        role: str,
        ident: str,
        *,
        deadline: float = HELLO_DEADLINE,
        welcome: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Run the server side; returns the client's auth frame. ``secret``: the shared
        secret, or a `SecretOf` that picks it from the client's auth frame (a tenant's); one
        that picks none is refused exactly as a bad proof is, after as much work. Raises
        AuthError (bad proof: an "err" frame was sent), ProtocolError, TransferTimeoutError,
        ConnectionError."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        await self.send(
            {"op": "challenge", "v": VERSION, "role": role, "id": ident, "nonce": nonce}
        )
        auth = await self._recv_hello(deadline, "auth frame")
        peer_role, peer_id = auth.get("role"), auth.get("id")
        peer_nonce, mac = auth.get("nonce"), auth.get("mac")
        if not (
            auth.get("op") == "auth"
            and isinstance(peer_role, str)
            and isinstance(peer_id, str)
            and isinstance(peer_nonce, bytes)
            and len(peer_nonce) == NONCE_BYTES
            and isinstance(mac, bytes)
        ):
            raise ProtocolError("malformed auth frame")
        t = transcript(nonce, peer_nonce, role, ident, peer_role, peer_id)
        chosen = secret(auth) if callable(secret) else secret
        key = chosen if chosen is not None else _NO_SECRET  # the same work either way
        if not hmac.compare_digest(mac, proof(key, "client", t)) or chosen is None:
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(
                    self.send({"op": "err", "err": "auth", "msg": "authentication failed"}),
                    deadline,
                )
            raise AuthError(f"{peer_role} {peer_id!r} failed to authenticate")
        await self.send({"op": "welcome", "mac": proof(chosen, "server", t), **(welcome or {})})
        self._tx, self._rx = seals(session_keys(chosen, t), server=True)
        self.peer_role, self.peer_id = peer_role, peer_id
        return auth

    async def client_handshake(
        self,
        secret: bytes,
        role: str,
        ident: str,
        *,
        deadline: float = HELLO_DEADLINE,
        expect_role: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Run the client side; returns the server's welcome. Raises AuthError (refused, or a
        server that cannot prove the secret), ProtocolError, TransferTimeoutError,
        ConnectionError."""
        ch = await self._recv_hello(deadline, "challenge")
        s_role, s_id, s_nonce = ch.get("role"), ch.get("id"), ch.get("nonce")
        if not (
            ch.get("op") == "challenge"
            and isinstance(s_role, str)
            and isinstance(s_id, str)
            and isinstance(s_nonce, bytes)
            and len(s_nonce) == NONCE_BYTES
        ):
            raise ProtocolError(f"no challenge (version {ch.get('v')!r}; we speak {VERSION})")
        if expect_role is not None and s_role != expect_role:
            raise AuthError(f"the peer is a {s_role!r}, not a {expect_role!r}")
        nonce = secrets.token_bytes(NONCE_BYTES)
        t = transcript(s_nonce, nonce, s_role, s_id, role, ident)
        auth = {"op": "auth", "v": VERSION, "role": role, "id": ident, "nonce": nonce}
        await self.send({**auth, "mac": proof(secret, "client", t), **(extra or {})})
        welcome = await self._recv_hello(deadline, "welcome")
        if welcome.get("op") == "err":
            raise AuthError(f"refused: {str(welcome.get('msg', ''))[:200]}")
        mac = welcome.get("mac")
        if not (
            welcome.get("op") == "welcome"
            and isinstance(mac, bytes)
            and hmac.compare_digest(mac, proof(secret, "server", t))
        ):
            raise AuthError(f"{s_role} {s_id!r} did not prove the shared secret")
        self._tx, self._rx = seals(session_keys(secret, t), server=False)
        self.peer_role, self.peer_id = s_role, s_id
        return welcome

    def close(self) -> None:
        """Close the stream (idempotent)."""
        self.writer.close()
