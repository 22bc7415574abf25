"""TCP: peers across hosts. One-sided operations are emulated by a server on the target that
serves reads and writes against its registered regions (see tcp_server.py, tcp_wire.py).
This file stays whole (~420 lines): the client connection and the transport's chunking share
the pending-request record and the checksum thread; the server side and the framing are apart.

The initiator splits a batch into requests of at most `chunk_bytes`, pipelines them on one
connection per peer, and receives read payloads straight into its local regions. Responses come
back in request order, so a FIFO of pending requests is all the client keeps::

    client                                   server (target)
      read  id=1 segs=[[r,o,n]...]   ──────>   bounds-check
      read  id=2 ...                 ──────>
            <──────  data id=1 n | payload (recv_into local regions, checksummed as it lands)
            <──────  crc id=1 (the server's checksum, computed while the payload drains)
            <──────  data id=2 ...
      notify data=...                ──────>   delivered after both landed

Payload checksums (on by default) use the algorithm the handshake agreed on: CRC32C from the
native helper where both sides have it, zlib's CRC32 otherwise (see checksum.py).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import os
import secrets
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any

from .args import check_secret
from .base import DEFAULT_TIMEOUT_S, Direction, Transport
from .checksum import (
    Checksum,
    ChecksumThread,
    Incremental,
    Update,
    algorithms,
    checksum_function,
    spare_cores,
    update_function,
)
from .errors import (
    AuthError,
    ChecksumError,
    InvalidInputError,
    PeerError,
    ProtocolError,
    RemoteAccessError,
    TransportError,
)
from .guard import Audit, Gate
from .handle import BatchHandle
from .regions import MEMORY_KINDS, Capabilities, TransferOp, group_by_peer
from .session import HELLO_DEADLINE, proof, seals, session_keys, transcript
from .tcp_server import ServerSide, TcpServer
from .tcp_wire import (
    CLIENT_ROLE,
    HEADER_LIMITS,
    MAX_HEADER,
    SERVER_ROLE,
    WIRE_VERSION,
    FrameProtocol,
)

__all__ = ["TcpTransport"]

SECRET_ENV = "TIERKV_TRANSPORT_SECRET"
_ERRORS: dict[str, type[TransportError]] = {
    "access": RemoteAccessError,
    "checksum": ChecksumError,
    "protocol": ProtocolError,
    "auth": AuthError,
}


@dataclass(slots=True)
class _Pending:
    kind: str
    views: list[memoryview]
    future: asyncio.Future[None]
    crc: bool = False
    nbytes: int = field(default=0)


class ClientConnection(FrameProtocol):
    """Our connection to one peer's server: handshake, then a FIFO of pending requests."""

    def __init__(self, owner: TcpTransport, agent: str) -> None:
        super().__init__()
        self.owner, self.agent = owner, agent
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.max_segs = 0
        self.peer_max_payload = 0
        self._transcript = b""
        self._nonce = secrets.token_bytes(16)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._ids = 0
        self.csum_name = "crc32"
        self.csum: Checksum = checksum_function("crc32")  # until the handshake agrees
        self.csum_update: Update = update_function("crc32")
        self._rx: Incremental | None = None  # the checksum of the read payload landing now
        # a read whose payload landed: (request id, its record, our crc) until its "crc" frame
        self._trailer: tuple[int, _Pending, int | None] | None = None

    def request(
        self, kind: str, segs: list[list[int]], views: list[memoryview], crc: int | None = None
    ) -> _Pending:
        """Send one read or write request (a write carries the payload's checksum `crc`, if
        given; a read asks for one when checksums are on). Its `future` resolves with the
        response. Raises PeerError at once when the connection is already gone.
        """
        if self.closed:
            raise PeerError(f"{self.agent}: connection lost")
        self._ids += 1
        want = self.owner.checksum and kind == "read"
        p = _Pending(kind, views, asyncio.get_running_loop().create_future(), want)
        header: dict[str, Any] = {"op": kind, "id": self._ids, "segs": segs}
        if kind == "write":
            header["n"] = sum(len(v) for v in views)
            if crc is not None:
                header["crc"] = crc
        elif want:
            header["crc"] = True
        self._pending.append(p)
        self.send(header, views if kind == "write" else ())
        return p

    def on_header(self, header: dict[str, Any]) -> list[memoryview] | None:
        if header["op"] == "data":
            if self._trailer is not None or not self._pending or self._pending[0].kind != "read":
                raise ProtocolError("unexpected data frame")  # before it lands anywhere
            p = self._pending[0]
            self._rx = Incremental(self.csum_update) if p.crc else None
            return p.views
        return None

    def on_payload(self, landed: memoryview) -> None:
        if self._rx is not None:
            self._rx.add(landed)

    def on_frame(self, header: dict[str, Any]) -> None:
        op = header["op"]
        if not self.ready.done():
            return self._handshake(header)
        if self._trailer is not None:
            return self._check_trailer(header)
        rid = self._ids - len(self._pending) + 1
        if not self._pending or header.get("id") not in (-1, None, rid):
            raise ProtocolError(f"unexpected {op!r} frame for request {header.get('id')!r}")
        p = self._pending.popleft()
        if op == "data" and p.kind == "read" and p.crc:
            rx, self._rx = self._rx, None
            crc = rx.finish() if rx is not None else None
            if "crc" not in header:  # version 2: a "crc" frame follows
                self._trailer = (rid, p, crc)
            elif not p.future.done():  # version 1: the crc came in the header
                self._settle(p, header["crc"], crc)
        elif p.future.done():
            return
        elif op == "err":
            code = header.get("code")
            cls = _ERRORS.get(code, RemoteAccessError) if isinstance(code, str) else ProtocolError
            p.future.set_exception(cls(f"{self.agent}: {header.get('msg', '')}"))
        elif (op, p.kind) in (("data", "read"), ("ok", "write")):
            p.future.set_result(None)
        else:
            raise ProtocolError(f"{op!r} frame answers a {p.kind}")

    def _check_trailer(self, header: dict[str, Any]) -> None:
        assert self._trailer is not None
        rid, p, crc = self._trailer
        if header["op"] != "crc" or header.get("id") != rid:
            raise ProtocolError(f"{header['op']!r} frame where the crc of request {rid} belongs")
        self._trailer = None
        if not p.future.done():
            self._settle(p, header.get("crc"), crc)

    def _settle(self, p: _Pending, announced: Any, computed: int | None) -> None:
        if computed is None or announced != computed:
            p.future.set_exception(ChecksumError(f"{self.agent}: read payload crc mismatch"))
        else:
            p.future.set_result(None)

    def _handshake(self, header: dict[str, Any]) -> None:
        secret, op = self.owner._secret, header["op"]
        nonce = header.get("nonce")
        if op == "challenge" and not self._transcript and isinstance(nonce, bytes):
            if header.get("v") != WIRE_VERSION:
                self.ready.set_exception(
                    AuthError(
                        f"{self.agent!r} speaks wire version {header.get('v')!r}, "
                        f"not {WIRE_VERSION}"
                    )
                )
                return self.abort()
            # bound to the agent we mean to reach: an impostor's proof cannot match
            self._transcript = transcript(
                nonce, self._nonce, SERVER_ROLE, self.agent, CLIENT_ROLE, self.owner.name
            )
            auth = {"op": "auth", "v": WIRE_VERSION, "csums": list(algorithms())}
            ours = proof(secret, "client", self._transcript)
            return self.send({**auth, "agent": self.owner.name, "nonce": self._nonce, "mac": ours})
        t = self._transcript
        mac = header.get("mac")
        if (
            op == "welcome"
            and t
            and isinstance(mac, bytes)
            and hmac.compare_digest(mac, proof(secret, "server", t))
        ):
            csum = header.get("csum")
            if not isinstance(csum, str) or csum not in algorithms():
                self.ready.set_exception(
                    AuthError(f"{self.agent!r} chose checksum {csum!r}, not one of ours")
                )
                return self.abort()
            max_segs, max_payload = header.get("max_segs"), header.get("max_payload")
            if type(max_segs) is not int or type(max_payload) is not int:
                self.ready.set_exception(AuthError(f"{self.agent!r} sent a malformed welcome"))
                return self.abort()
            self.csum_name, self.csum = csum, checksum_function(csum)
            self.csum_update = update_function(csum)
            self.max_header, self.max_payload = MAX_HEADER, self.owner.max_frame
            self.max_segs = max(1, max_segs)
            self.peer_max_payload = max(1, max_payload)
            self.tx_seal, self.rx_seal = seals(session_keys(secret, t), server=False)
            self.limits = HEADER_LIMITS
            return self.ready.set_result(None)
        why = f"{op}: {str(header.get('msg', ''))[:200]}" if op == "err" else op
        self.ready.set_exception(AuthError(f"handshake with {self.agent!r} failed ({why})"))
        self.abort()

    def on_protocol_error(self, exc: ProtocolError) -> None:
        self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._fail(PeerError(f"connection to {self.agent!r} lost"))
        if self.owner._conns.get(self.agent) is self:
            del self.owner._conns[self.agent]

    def _fail(self, exc: TransportError) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc if isinstance(exc, PeerError) else PeerError(str(exc)))
        held = [self._trailer[1]] if self._trailer is not None else []
        self._trailer = None
        for p in [*held, *self._pending]:
            if not p.future.done():
                p.future.set_exception(exc)
        self._pending.clear()


class TcpTransport(Transport):
    """Network transport: an asyncio server on `host:port` serves our regions to peers that
    share `secret` (default: the TIERKV_TRANSPORT_SECRET environment variable).

    `advertise` is the host peers should dial (default `host`); `max_frame` caps a frame's
    payload; `chunk_bytes` is the largest request we send; `checksum` adds a checksum to every
    payload (CRC32C or CRC32, agreed per connection; a mismatch raises ChecksumError). Read
    payloads are checksummed as they land; the checksums we send are computed in a worker
    thread when `checksum_thread` (default: when this process may use 4 or more CPUs).
    `ssl_server` / `ssl_client`: TLS contexts for our server and our connections (encrypts
    headers and payloads; the shared-secret handshake still runs inside; docs/security.md).
    `max_conns_per_peer` / `max_preauth_per_peer` / `max_preauth` / `max_preauth_failures`:
    our server's admission by address, decided before anything is read (guard.Gate: open and
    unauthenticated connections per address, unauthenticated ones in all, failed handshakes an
    address may have at once, None: no penalty); refused connections are held unread for the
    hello deadline, then reset.
    """

    kind = "tcp"
    capabilities = Capabilities(frozenset(MEMORY_KINDS[:2]), "emulated", "network")

    def __init__(
        self,
        name: str | None = None,
        *,
        secret: bytes | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_frame: int = 64 << 20,
        chunk_bytes: int = 4 << 20,
        checksum: bool = True,
        checksum_thread: bool | None = None,
        max_conns_per_peer: int = 256,
        max_preauth_per_peer: int = 32,
        max_preauth: int = 1024,
        max_preauth_failures: int | None = 64,
        ssl_server: SSLContext | None = None,
        ssl_client: SSLContext | None = None,
    ) -> None:
        self.ssl_server, self.ssl_client = ssl_server, ssl_client
        super().__init__(name, timeout=timeout)
        secret = check_secret(secret)
        env = os.environ.get(SECRET_ENV)
        if secret is None and env is None:
            raise InvalidInputError(
                f"tcp transport needs a shared secret (secret= or ${SECRET_ENV})"
            )
        if secret is None and not env:
            raise InvalidInputError(f"${SECRET_ENV} is empty: an empty secret is not a secret")
        self._secret = secret if secret is not None else (env or "").encode()
        self.host, self.port, self.advertise = host, port, advertise or host
        self.max_frame, self.chunk_bytes, self.checksum = max_frame, chunk_bytes, checksum
        self._conns: dict[str, ClientConnection] = {}
        self.audit = Audit("tcp")
        threaded = spare_cores() if checksum_thread is None else checksum_thread
        self._checksums = ChecksumThread(threaded)
        self._serving = ServerSide(
            name=self.name,
            secret=self._secret,
            timeout=timeout,
            max_frame=max_frame,
            audit=self.audit,
            gate=Gate(
                per_peer=max_conns_per_peer,
                preauth_per_peer=max_preauth_per_peer,
                preauth_total=max_preauth,
                failures=max_preauth_failures,
            ),
            checksums=self._checksums,
            deliver=self.deliver_notification,
            serve_view=self.serve_view,
            write_guard=lambda: self.write_guard,
            read_guard=lambda: self.read_guard,
            hello_deadline=min(timeout, HELLO_DEADLINE),
        )
        self._server = TcpServer(self._serving, ssl=ssl_server, hold_s=min(timeout, HELLO_DEADLINE))

    async def _start(self) -> None:
        self.port = self._server.start(self.host, self.port)

    def write_fence(self, agent: str | None) -> asyncio.Future[None]:
        """Done once the writes of ``agent`` (None: anyone) our server is receiving now have
        landed or dropped: every later write asks `write_guard` again before it lands."""
        return self._serving.landing.fence(agent)

    def _peer_fields(self) -> dict[str, Any]:
        return {"host": self.advertise, "port": self.port}

    async def _add_peer(self, info: dict[str, Any]) -> None:
        if not isinstance(info.get("host"), str) or type(info.get("port")) is not int:
            raise PeerError(f"tcp metadata of {info['agent']!r} lacks host/port")
        old = self._conns.pop(info["agent"], None)
        if old is not None:
            old.abort()
        await self._connect(info["agent"], info)

    async def _connect(self, agent: str, info: dict[str, Any] | None = None) -> ClientConnection:
        known = self._conns.get(agent)
        if known is not None and not known.closed:
            await asyncio.wait_for(asyncio.shield(known.ready), self.timeout)
            return known
        info = info or self._peers[agent]
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: ClientConnection(self, agent),
                    info["host"],
                    info["port"],
                    ssl=self.ssl_client,
                ),
                self.timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise PeerError(
                f"cannot reach tcp peer {agent!r} at {info['host']}:{info['port']}"
            ) from exc
        self._conns[agent] = conn
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), self.timeout)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _transfer(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: BatchHandle,
    ) -> None:
        by_peer = group_by_peer(ops)
        conns = await asyncio.gather(*(self._connect(a) for a in by_peer))
        for conn in conns:
            handle.on_abort(conn.abort)
        await asyncio.gather(*(self._run(c, direction, by_peer[c.agent]) for c in conns))
        if notify is not None:
            for conn in conns:
                conn.send({"op": "notify", "data": bytes(notify)})
            await asyncio.gather(*(c.drain() for c in conns))

    async def _run(self, conn: ClientConnection, direction: str, ops: list[TransferOp]) -> None:
        limit = max(1, min(self.chunk_bytes, conn.peer_max_payload, self.max_frame))
        pending, segs, views, size = [], [], [], 0
        for local, lo, remote, ro, n in ops:
            while n > 0:
                take = min(n, limit - size)
                segs.append([remote.region_id, ro, take])
                views.append(local.view[lo : lo + take])
                size, lo, ro, n = size + take, lo + take, ro + take, n - take
                if size >= limit or len(segs) >= conn.max_segs:
                    pending.append(await self._request(conn, direction, segs, views))
                    segs, views, size = [], [], 0
                    await conn.drain()
        if segs:
            pending.append(await self._request(conn, direction, segs, views))
        await asyncio.gather(*pending)

    async def _request(
        self, conn: ClientConnection, direction: str, segs: list[list[int]], views: list[memoryview]
    ) -> asyncio.Future[None]:
        """Send one request; a write's checksum is computed first (in the checksum thread, while
        the loop sends the previous requests' payloads)."""
        crc = None
        if direction == "write" and self.checksum:
            crc = await self._checksums.compute(conn.csum, views)
        return conn.request(direction, segs, views, crc).future

    async def _close(self) -> None:
        self._server.close()
        for conn in self._conns.values():
            conn.abort()
        self._conns.clear()
        self._checksums.close()
