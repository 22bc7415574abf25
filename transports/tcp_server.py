"""The tcp transport's server side: `TcpServer` accepts, one `ServerConnection` per admitted peer.

Admission is decided from the peer's address before anything is read (acceptor.py, guard.Gate:
at most `max_preauth_per_peer` connections per address at the handshake, 1,024 in all, and a
penalty for an address whose handshakes keep failing; refused connections are held unread,
then reset). A connection authenticates the peer (challenge -> auth -> welcome: the mutual
handshake of session.py, which also settles the wire version and the checksum algorithm,
within the timeout), then serves
requests in order (every header tagged under the session's keys):
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
import functools
import hmac
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any

from .acceptor import Acceptor, listen
from .checksum import Checksum, ChecksumThread, algorithms, checksum_function
from .errors import ProtocolError, RemoteAccessError
from .fence import Landing, ReadGuard, WriteGuard
from .guard import AUTH_REFUSED, BUDGET_HIT, PROTOCOL_ERROR, Audit, Gate
from .session import NONCE_BYTES, proof, seals, session_keys, transcript
from .tcp_wire import (
    CLIENT_ROLE,
    HEADER_LIMITS,
    MAX_HEADER,
    MAX_SEGS,
    SERVER_ROLE,
    WIRE_VERSION,
    FrameProtocol,
    parse_segs,
)

__all__ = ["ServerConnection", "ServerSide", "TcpServer"]


@dataclass(slots=True)
class ServerSide:
    """What the server connections of one transport share with it (the transport builds it;
    this module never imports the transport): its identity and secret, the bounds, the
    security counters and the admission gate, the checksum thread, where notifications go
    (``deliver``: False when over its budget) and how a request's segment resolves
    (``serve_view``: raises RemoteAccessError), who may write where (``write_guard``: the
    transport's `guard_writes`, read per write) and read where (``read_guard``: its
    `guard_reads`, read per read), the writes landing now (``landing``), the
    hello deadline (``hello_deadline``: an unauthenticated connection is dropped after it),
    and the connections open now (closed with the transport)."""

    name: str
    secret: bytes
    timeout: float
    max_frame: int
    audit: Audit
    gate: Gate
    checksums: ChecksumThread
    deliver: Callable[[str, bytes], bool]
    serve_view: Callable[[int, int, int], memoryview]
    write_guard: Callable[[], WriteGuard | None]
    read_guard: Callable[[], ReadGuard | None]
    hello_deadline: float
    landing: Landing = field(default_factory=Landing)
    conns: set[ServerConnection] = field(default_factory=set)


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
    """Serves one authenticated peer against the regions `owner` resolves (``address``: the
    peer's, as the gate admitted it; the gate hears of its handshake and its end)."""

    def __init__(self, owner: ServerSide, address: str) -> None:
        super().__init__()
        self.owner = owner
        self.peer: str | None = None
        self._nonce = secrets.token_bytes(16)
        self._refusal: dict[str, Any] | None = None  # answer for a write whose payload we drop
        self._views: list[memoryview] = []
        self._timer: asyncio.TimerHandle | None = None
        self.csum: Checksum = checksum_function("crc32")  # until the handshake agrees
        self._replies: collections.deque[_Reply] = collections.deque()
        self.version = WIRE_VERSION
        self.address = address
        self._preauth = True  # admitted by the gate, not authenticated yet
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.owner.conns.add(self)
        self._timer = asyncio.get_running_loop().call_later(self.owner.hello_deadline, self._expire)
        challenge = {"op": "challenge", "v": WIRE_VERSION, "agent": self.owner.name}
        self.send({**challenge, "nonce": self._nonce})

    def _expire(self) -> None:
        if self.peer is None:
            self.owner.audit.note(BUDGET_HIT, self.address, "hello_deadline")
            self.abort()

    def _authenticated(self) -> None:
        if self._preauth:
            self._preauth = False
            self.owner.gate.authenticated(self.address)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._preauth:
            self.owner.gate.failed(self.address)  # every unauthenticated end is a strike
        self.owner.gate.closed(self.address, authenticated=not self._preauth)
        self.owner.conns.discard(self)
        self.owner.landing.ended(self)  # a write cut short lands no further
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
        if self._refused:
            return  # refused authentication: answered and counted already
        self.owner.audit.note(PROTOCOL_ERROR, self.address, "malformed", detail=exc)
        self.send({"op": "err", "id": -1, "code": "protocol", "msg": str(exc)[:200]})

    def on_header(self, header: dict[str, Any]) -> list[memoryview] | None:
        if header["op"] != "write" or self.peer is None:
            return None
        self._refusal, self._views = None, []
        try:
            self._views = self._resolve(header)
            self._guard(header)
        except RemoteAccessError as exc:
            self._refusal, self._views = _err(header, "access", exc), []
            return None
        self.owner.landing.started(self, self.peer)
        return self._views

    def _guard(self, header: dict[str, Any], what: str = "write") -> None:
        """Refuse (RemoteAccessError) a write (a read) the owner's guard does not let in."""
        guard = self.owner.write_guard() if what == "write" else self.owner.read_guard()
        if guard is None:
            return
        assert self.peer is not None
        for rid, off, n in parse_segs(header, MAX_SEGS):
            if not guard(self.peer, rid, off, n):
                raise RemoteAccessError(f"[{off}, {off + n}) of region {rid} is not ours to {what}")

    def on_frame(self, header: dict[str, Any]) -> None:
        op = header["op"]
        if self.peer is None:
            return self._authenticate(header)
        if op == "read":
            try:
                views = self._resolve(header)
                self._guard(header, "read")
            except RemoteAccessError as exc:
                return self._reply(_Reply(_err(header, "access", exc)))
            reply = _Reply({"op": "data", "id": header.get("id"), "n": sum(map(len, views))}, views)
            if not header.get("crc"):
                return self._reply(reply)
            # version 2: the payload leaves at once, its crc follows (computed meanwhile);
            # version 1: the crc is in the header, so the reply waits for it
            reply.wants_trailer, reply.held = self.version >= 2, self.version < 2
            self._reply(reply)
            crc = self.owner.checksums.compute(self.csum, views)
            crc.add_done_callback(lambda f: self._checksummed(reply, f))
            return None
        if op == "write":
            self.owner.landing.ended(self)  # its payload has landed: nothing more from it
            if self._refusal is not None:
                return self._reply(_Reply(self._refusal))
            reply = _Reply({"op": "ok", "id": header.get("id")})
            if header.get("crc") is not None:
                reply.held = True
                crc = self.owner.checksums.compute(self.csum, self._views)
                crc.add_done_callback(lambda f: self._verified(reply, header, f))
            return self._reply(reply)
        if op == "notify" and isinstance(header.get("data"), bytes):
            if not self.owner.deliver(self.peer, header["data"]):
                self.owner.audit.note(BUDGET_HIT, self.address, "notifications", agent=self.peer)
                self.abort()
            return None
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
        views = [self.owner.serve_view(rid, off, n) for rid, off, n in segs]
        if sum(len(v) for v in views) > self.max_payload:
            raise ProtocolError("request larger than the frame limit")
        return views

    def _authenticate(self, header: dict[str, Any]) -> None:
        agent, nonce, mac = header.get("agent"), header.get("nonce"), header.get("mac")
        secret = self.owner.secret
        t = b""
        if (
            header["op"] == "auth"
            and isinstance(agent, str)
            and isinstance(nonce, bytes)
            and len(nonce) == NONCE_BYTES
            and isinstance(mac, bytes)
        ):
            t = transcript(self._nonce, nonce, SERVER_ROLE, self.owner.name, CLIENT_ROLE, agent)
        if not (
            t and isinstance(mac, bytes) and hmac.compare_digest(mac, proof(secret, "client", t))
        ):
            self.owner.audit.note(AUTH_REFUSED, self.address, "bad proof", agent=agent)
            self.send({"op": "err", "id": -1, "code": "auth", "msg": "authentication failed"})
            self._refused = True
            raise ProtocolError("authentication failed")
        assert isinstance(agent, str)
        if header.get("v") != WIRE_VERSION:
            raise ProtocolError(f"wire version {header.get('v')!r}; we speak {WIRE_VERSION}")
        csum = _choose_checksum(header)
        if csum is None:
            # answered by on_protocol_error (an "err" frame), then the connection is dropped
            raise ProtocolError(f"no common checksum (we speak v{WIRE_VERSION}: {algorithms()})")
        self.csum = checksum_function(csum)
        self.peer = agent
        self._authenticated()
        self.max_header, self.max_payload = MAX_HEADER, self.owner.max_frame
        if self._timer is not None:
            self._timer.cancel()
        self.send(
            {
                "op": "welcome",
                "v": WIRE_VERSION,
                "csum": csum,
                "mac": proof(secret, "server", t),
                "max_payload": self.owner.max_frame,
                "max_segs": MAX_SEGS,
            }
        )
        self.tx_seal, self.rx_seal = seals(session_keys(secret, t), server=True)
        self.limits = HEADER_LIMITS


class TcpServer:
    """The accepting end of one tcp transport: an `Acceptor` admitting by address through
    ``side.gate``, then a `ServerConnection` per admitted peer (inside TLS with ``ssl``).
    ``hold_s`` / ``max_held``: the tarpit of refused connections."""

    def __init__(
        self,
        side: ServerSide,
        *,
        ssl: SSLContext | None = None,
        hold_s: float = 5.0,
        max_held: int = 256,
    ) -> None:
        self.side, self.ssl, self.hold_s, self.max_held = side, ssl, hold_s, max_held
        self._acceptor: Acceptor | None = None
        self._starting: set[asyncio.Task[Any]] = set()  # admitted, TLS handshake running

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any) and accept; returns the port. Raises OSError."""
        self._acceptor = Acceptor(
            listen(host, port),
            self.side.gate,
            self._admitted,
            self.side.audit,
            hold_s=self.hold_s,
            max_held=self.max_held,
        )
        self._acceptor.start()
        return self._acceptor.port

    def close(self) -> None:
        """Stop accepting; drop held, starting and open connections."""
        if self._acceptor is not None:
            self._acceptor.close()
        for task in list(self._starting):
            task.cancel()
        for conn in list(self.side.conns):
            conn.abort()

    def _admitted(self, sock: socket.socket, address: str) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(
            loop.connect_accepted_socket(
                lambda: ServerConnection(self.side, address),
                sock,
                ssl=self.ssl,
                ssl_handshake_timeout=self.side.hello_deadline if self.ssl is not None else None,
            )
        )
        self._starting.add(task)
        task.add_done_callback(functools.partial(self._started, sock, address))

    def _started(self, sock: socket.socket, address: str, task: asyncio.Task[Any]) -> None:
        self._starting.discard(task)
        if not task.cancelled() and task.exception() is None:
            return  # the connection reports to the gate from now on
        sock.close()  # the TLS handshake failed (or we are closing): it never started
        self.side.gate.closed(address, authenticated=False)
        self.side.gate.failed(address)
        if not task.cancelled():
            self.side.audit.note(PROTOCOL_ERROR, address, "tls", detail=task.exception())


def _choose_checksum(auth: dict[str, Any]) -> str | None:
    """The checksum for a peer's auth frame: its first choice we have."""
    offered = auth.get("csums")
    if not isinstance(offered, list):
        return None
    ours = algorithms()
    return next((c for c in offered if isinstance(c, str) and c in ours), None)


def _err(header: dict[str, Any], code: str, exc: Exception) -> dict[str, Any]:
    return {"op": "err", "id": header.get("id"), "code": code, "msg": str(exc)[:200]}
