"""A blocking peer that speaks the session framing over a plain socket: for probes, fuzzers and
tests that must send exactly the bytes they mean (hostile ones included).

::

    p = Probe.connect("127.0.0.1", port)
    p.handshake(secret, role="client", ident="probe")       # page server / shm control socket
    p.tcp_handshake(secret, agent="probe", csums=["crc32"])  # tcp transport
    p.send({"op": "lookup", "id": 1, "keys": [...]})         # tagged once authenticated
    p.recv()                                                 # a dict, or None at EOF
"""

from __future__ import annotations

import hmac
import secrets
import socket
from typing import Any

import msgpack

from .errors import AuthError, ProtocolError
from .session import (
    PREFIX,
    TAG_BYTES,
    VERSION,
    Limits,
    Seal,
    proof,
    seals,
    session_keys,
    transcript,
    unpack,
)

__all__ = ["REPLY_LIMITS", "Probe"]

REPLY_LIMITS = Limits(frame=8 << 20, array=1 << 18, map=64, str=1 << 16, bin=1 << 20)
"""What a probe decodes of a frame the other end sent (it may be hostile too): a page server's
largest reply, as ``tierkv.remote.protocol.wire.REPLY_LIMITS`` bounds it."""


class Probe:
    """One blocking connection; `tx` / `rx` seal frames once a handshake completed. Frames it
    receives are decoded within ``limits``."""

    def __init__(self, sock: socket.socket, limits: Limits = REPLY_LIMITS) -> None:
        self.sock = sock
        self.limits = limits
        self.tx: Seal | None = None
        self.rx: Seal | None = None

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 5.0) -> Probe:
        """Dial ``host:port``. Raises OSError."""
        return cls(socket.create_connection((host, port), timeout=timeout))

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exactly(self, n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    def recv(self) -> dict[str, Any] | None:
        """The next frame (tag checked once authenticated), or None at EOF. Raises AuthError
        (bad tag), ProtocolError (not a map), OSError."""
        head = self._exactly(4)
        if head is None:
            return None
        (n,) = PREFIX.unpack(head)
        if n > self.limits.frame + TAG_BYTES:  # before reading it: the length is the peer's
            raise ProtocolError(f"frame of {n} bytes (limit {self.limits.frame})")
        raw = self._exactly(n)
        if raw is None:
            return None
        if self.rx is not None:
            raw, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
            self.rx.check(raw, tag)
        return unpack(raw, self.limits)

    def frame(self, obj: dict[str, Any] | bytes) -> bytes:
        """The bytes of one frame (a map, or a raw body), tagged when authenticated."""
        body = obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True)
        tag = self.tx.tag(body) if self.tx is not None else b""
        return PREFIX.pack(len(body) + len(tag)) + body + tag

    def send(self, obj: dict[str, Any] | bytes, payload: bytes = b"") -> None:
        """Send one frame (and a raw payload after it)."""
        self.sock.sendall(self.frame(obj) + payload)

    def handshake(
        self, secret: bytes, role: str = "client", ident: str = "probe", **fields: Any
    ) -> dict[str, Any]:
        """The client side of the session handshake (``fields`` added to the auth frame, e.g.
        a page server's ``tenant``); returns the welcome. Raises AuthError."""
        ch = self.recv()
        if ch is None or ch.get("op") != "challenge":
            raise AuthError(f"no challenge: {ch!r}")
        nonce = secrets.token_bytes(16)
        t = transcript(ch["nonce"], nonce, ch["role"], ch["id"], role, ident)
        auth = {"op": "auth", "v": VERSION, "role": role, "id": ident, "nonce": nonce}
        self.send({**auth, "mac": proof(secret, "client", t), **fields})
        return self._welcome(secret, t)

    def tcp_handshake(self, secret: bytes, agent: str = "probe", **fields: Any) -> dict[str, Any]:
        """The client side of the tcp transport's handshake (``fields`` added to the auth
        frame, e.g. ``csums``); returns the welcome. Raises AuthError."""
        ch = self.recv()
        if ch is None or ch.get("op") != "challenge":
            raise AuthError(f"no challenge: {ch!r}")
        nonce = secrets.token_bytes(16)
        t = transcript(ch["nonce"], nonce, "tcp-server", ch["agent"], "tcp-client", agent)
        auth = {"op": "auth", "v": 3, "agent": agent, "nonce": nonce, "csums": ["crc32"]}
        self.send({**auth, "mac": proof(secret, "client", t), **fields})
        return self._welcome(secret, t)

    def _welcome(self, secret: bytes, t: bytes) -> dict[str, Any]:
        welcome = self.recv()
        if welcome is None or welcome.get("op") != "welcome":
            return welcome or {}
        mac = welcome.get("mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, proof(secret, "server", t)):
            raise AuthError("the server did not prove the secret")
        self.tx, self.rx = seals(session_keys(secret, t), server=False)
        return welcome
