"""The tcp transport's server side: one `ServerConnection` per accepted peer.

It authenticates the peer (challenge -> auth -> welcome, which also settles the wire version and
the checksum algorithm), then serves requests in order:
"read" (answered by "data" + payload, then a "crc" frame when asked for one), "write" (payload
received straight into the region, answered by "ok"), "notify" (no answer). Every segment is
bounds-checked against the regions registered at that moment; a refused request gets an "err"
frame and the connection lives on.
A frame that breaks the protocol gets an "err" (when possible) and the connection is dropped.

Replies leave in request order through a small queue. A read's payload leaves at once and its
crc is computed while the socket drains it (in the checksum thread, or inline right after the
send was queued); the "crc" frame follows before any later reply. A write's verdict waits for
its checksum::

    requests   read#1             read#2             write#3 (crc)      write#4 (bad bounds)
    wire       data#1 + payload   ...crc#1           data#2 + payload   crc#2  ok#3  err#4
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .checksum import Checksum, algorithms, checksum_function
from .errors import ProtocolError, RemoteAccessError
from .tcp_wire import MAX_HEADER, MAX_SEGS, WIRE_VERSION, FrameProtocol, mac, parse_segs

if TYPE_CHECKING:
    from .tcp import TcpTransport

__all__ = ["ServerConnection"]


@dataclass(slots=True)
class _Reply:
    """One answer. Its `header` and `views` leave when it reaches the head of the queue (unless
    `held`: a verdict or header crc still being computed); a `trailer` (a version-2 read's
    "crc" frame) must follow before the next reply, once known."""

    header: dict[str, Any]
    views: list[memoryview] = field(default_factory=list)
    held: bool = False
    wants_trailer: bool = False
    trailer: dict[str, Any] | None = None
    sent: bool = False


class ServerConnection(FrameProtocol):
    """Serves one authenticated peer against `owner`'s registered regions."""

    def __init__(self, owner: TcpTransport) -> None:
        super().__init__()
        self.owner = owner
        self.peer: str | None = None
        self._nonce = secrets.token_bytes(16)
        self._refusal: dict[str, Any] | None = None  # answer for a write whose payload we drop
        self._views: list[memoryview] = []
        self._timer: asyncio.TimerHandle | None = None
        self.csum: Checksum = checksum_function("crc32")  # until the handshake agrees
        self._replies: collections.deque[_Reply] = collections.deque()
        self.version = 1  # the peer's wire version (from its auth frame)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.owner._server_conns.add(self)
        self._timer = asyncio.get_running_loop().call_later(self.owner.timeout, self._expire)
        challenge = {"op": "challenge", "v": WIRE_VERSION, "agent": self.owner.name}
        self.send({**challenge, "nonce": self._nonce})

    def _expire(self) -> None:
        if self.peer is None:
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.owner._server_conns.discard(self)
        if self._timer is not None:
            self._timer.cancel()

    def pause_writing(self) -> None:  # stop taking requests while replies pile up
        super().pause_writing()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def on_protocol_error(self, exc: ProtocolError) -> None:
        self.send({"op": "err", "id": -1, "code": "protocol", "msg": str(exc)[:200]})

    def on_header(self, header: dict[str, Any]) -> list[memoryview] | None:
        if header["op"] != "write" or self.peer is None:
            return None
        self._refusal, self._views = None, []
        try:
            self._views = self._resolve(header)
        except RemoteAccessError as exc:
            self._refusal = _err(header, "access", exc)
            return None
        return self._views

    def on_frame(self, header: dict[str, Any]) -> None:
        op = header["op"]
        if self.peer is None:
            return self._authenticate(header)
        if op == "read":
            try:
                views = self._resolve(header)
            except RemoteAccessError as exc:
                return self._reply(_Reply(_err(header, "access", exc)))
            reply = _Reply({"op": "data", "id": header.get("id"), "n": sum(map(len, views))}, views)
            if not header.get("crc"):
                return self._reply(reply)
            # version 2: the payload leaves at once, its crc follows (computed meanwhile);
            # version 1: the crc is in the header, so the reply waits for it
            reply.wants_trailer, reply.held = self.version >= 2, self.version < 2
            self._reply(reply)
            crc = self.owner._checksums.compute(self.csum, views)
            crc.add_done_callback(lambda f: self._checksummed(reply, f))
            return None
        if op == "write":
            if self._refusal is not None:
                return self._reply(_Reply(self._refusal))
            reply = _Reply({"op": "ok", "id": header.get("id")})
            if header.get("crc") is not None:
                reply.held = True
                crc = self.owner._checksums.compute(self.csum, self._views)
                crc.add_done_callback(lambda f: self._verified(reply, header, f))
            return self._reply(reply)
        if op == "notify" and isinstance(header.get("data"), bytes):
            return self.owner._deliver(self.peer, header["data"])
        raise ProtocolError(f"unexpected {op!r} frame")

    def _reply(self, reply: _Reply) -> None:
        """Queue a reply; send every ready one at the head of the queue."""
        self._replies.append(reply)
        self._flush()

    def _flush(self) -> None:
        while self._replies:
            r = self._replies[0]
            if r.held:
                return
            if not r.sent:
                self.send(r.header, r.views)
                r.sent = True
            if r.wants_trailer:
                if r.trailer is None:
                    return
                self.send(r.trailer)
            self._replies.popleft()

    def _checksummed(self, reply: _Reply, crc: asyncio.Future[int]) -> None:
        if crc.cancelled() or crc.exception() is not None:
            return self.abort()  # the checksum thread was stopped: we are closing
        if reply.wants_trailer:
            reply.trailer = {"op": "crc", "id": reply.header["id"], "crc": crc.result()}
        else:
            reply.header["crc"], reply.held = crc.result(), False
        self._flush()

    def _verified(self, reply: _Reply, header: dict[str, Any], crc: asyncio.Future[int]) -> None:
        if crc.cancelled() or crc.exception() is not None:
            return self.abort()
        if crc.result() != header["crc"]:
            reply.header = _err(header, "checksum", ProtocolError("checksum mismatch"))
        reply.held = False
        self._flush()

    def _resolve(self, header: dict[str, Any]) -> list[memoryview]:
        segs = parse_segs(header, MAX_SEGS)
        views = [self.owner._serve_view(rid, off, n) for rid, off, n in segs]
        if sum(len(v) for v in views) > self.max_payload:
            raise ProtocolError("request larger than the frame limit")
        return views

    def _authenticate(self, header: dict[str, Any]) -> None:
        agent, nonce, proof = header.get("agent"), header.get("nonce"), header.get("mac")
        secret = self.owner._secret
        if not (
            header["op"] == "auth"
            and isinstance(agent, str)
            and isinstance(nonce, bytes)
            and isinstance(proof, bytes)
            and hmac.compare_digest(
                proof, mac(secret, b"tierkv-client", self._nonce, nonce, agent.encode())
            )
        ):
            self.send({"op": "err", "id": -1, "code": "auth", "msg": "authentication failed"})
            raise ProtocolError("authentication failed")
        csum = _choose_checksum(header)
        if csum is None:
            # answered by on_protocol_error (an "err" frame), then the connection is dropped
            raise ProtocolError(f"no common checksum (we speak v{WIRE_VERSION}: {algorithms()})")
        self.csum = checksum_function(csum)
        self.version = min(header.get("v", 1), WIRE_VERSION)
        self.peer = agent
        self.max_header, self.max_payload = MAX_HEADER, self.owner.max_frame
        if self._timer is not None:
            self._timer.cancel()
        self.send(
            {
                "op": "welcome",
                "v": WIRE_VERSION,
                "csum": csum,
                "mac": mac(secret, b"tierkv-server", nonce, self._nonce, self.owner.name.encode()),
                "max_payload": self.owner.max_frame,
                "max_segs": MAX_SEGS,
            }
        )


def _choose_checksum(auth: dict[str, Any]) -> str | None:
    """The checksum for a peer's auth frame: its first choice we have (version 1: crc32)."""
    version = auth.get("v", 1)
    if version == 1:
        return "crc32"
    offered = auth.get("csums")
    if type(version) is not int or version < 2 or not isinstance(offered, list):
        return None
    ours = algorithms()
    return next((c for c in offered if isinstance(c, str) and c in ours), None)


def _err(header: dict[str, Any], code: str, exc: Exception) -> dict[str, Any]:
    return {"op": "err", "id": header.get("id"), "code": code, "msg": str(exc)[:200]}
