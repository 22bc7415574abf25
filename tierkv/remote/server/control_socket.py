"""The page server's control socket: accepting, admission, the handshake and the request loop,
whatever the requests mean (page_server.py answers them)::

    accept ─> Gate (by address, nothing read yet) ─> refused: held unread, then reset
                  │ admitted
                  v
    task: [TLS] ─> mutual handshake (hello <= 4 KiB, deadline) ─> gate.authenticated
                  │ failed: a strike against the address (a penalty past its budget)
                  v
          recv (tagged, REQUEST_LIMITS) ─> answer(msg, owner, session, address) ─> send
                  │ EOF / error
                  v
          closed(owner): leases and watches of that connection end

Every end is counted and logged by `audit` (refused authentication, protocol errors, budget
hits: the hello deadline, a send that does not drain within the timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from tierkv.remote.errors import RemoteProtocolError
from tierkv.remote.protocol.wire import PAGE_SERVER, REQUEST_LIMITS
from tierkv.transports import AuthError, ProtocolError, TransportError
from tierkv.transports.acceptor import Acceptor, listen
from tierkv.transports.guard import AUTH_REFUSED, BUDGET_HIT, PROTOCOL_ERROR, Audit, Gate
from tierkv.transports.session import HELLO_DEADLINE, SecretOf, StreamSession

__all__ = ["RCVBUF", "STREAM_LIMIT", "Answer", "ControlSocket", "Peer"]

#: the control sockets' receive buffer: bounds what one read of a hostile peer's bytes costs
#: (asyncio reads up to 256 KiB at once otherwise); control frames are small
RCVBUF = 1 << 15
#: the stream buffer of a control connection: what an unauthenticated peer makes us hold
STREAM_LIMIT = 1 << 14

#: answer(msg, owner, session, peer address) -> reply fields (an ``err`` field for a refusal)
Answer = Callable[[dict[str, Any], "Peer", StreamSession, str], dict[str, Any]]


class Peer:
    """One authenticated connection (its requests' ``owner``): the tenant whose secret it
    proved (None: the default secret)."""

    __slots__ = ("tenant",)

    def __init__(self) -> None:
        self.tenant: str | None = None


class ControlSocket:
    """Accept control connections on ``host:port`` and serve their requests with ``answer``.

    Args:
        secret: of the handshake, or a `SecretOf` choosing it from the client's auth frame
            (tenants); ident: our id in it (called per connection: our address).
        tenant_of: the tenant a client's auth frame names, once it proved that tenant's
            secret (None: the default).
        answer: a request's reply (raises RemoteProtocolError / ProtocolError to end the
            connection as malformed); closed: a connection (its ``owner`` token) ended.
        gate / audit: admission by address, and the security counters.
        timeout: a reply's send bound (and, with HELLO_DEADLINE, the hello's).
        ssl: TLS of the control socket (server side).
        hold_s / max_held: the acceptor's tarpit of refused connections.
    """

    def __init__(
        self,
        *,
        secret: bytes | SecretOf,
        ident: Callable[[], str],
        answer: Answer,
        closed: Callable[[object], None],
        tenant_of: Callable[[dict[str, Any]], str | None] = lambda auth: None,
        gate: Gate,
        audit: Audit,
        timeout: float,
        ssl: SSLContext | None = None,
        hold_s: float = HELLO_DEADLINE,
        max_held: int = 256,
    ) -> None:
        self.secret, self._ident, self._answer, self._closed = secret, ident, answer, closed
        self._tenant_of = tenant_of
        self.gate, self.audit, self.timeout, self.ssl = gate, audit, timeout, ssl
        self.hold_s, self.max_held = hold_s, max_held
        self.deadline = min(timeout, HELLO_DEADLINE)
        self._acceptor: Acceptor | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sessions: set[StreamSession] = set()

    @property
    def sessions(self) -> int:
        """Connections open now (authenticated or not; refused ones not counted)."""
        return len(self._sessions)

    @property
    def held(self) -> int:
        """Refused connections held unread now."""
        return self._acceptor.held if self._acceptor is not None else 0

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0: any) and start accepting; returns the port.
        Raises OSError."""
        socks = listen(host, port, rcvbuf=RCVBUF)  # accepted sockets inherit RCVBUF
        self._acceptor = Acceptor(
            socks, self.gate, self._admitted, self.audit, hold_s=self.hold_s, max_held=self.max_held
        )
        self._acceptor.start()
        return self._acceptor.port

    def stop_accepting(self) -> None:
        """Close the listening sockets and the held connections (idempotent)."""
        if self._acceptor is not None:
            self._acceptor.close()

    async def aclose(self) -> None:
        """Stop accepting, close every connection and wait (within the timeout) for their
        handlers to end; those still running then are cancelled (and waited for within the
        timeout again)."""
        self.stop_accepting()
        for s in list(self._sessions):  # handlers see EOF and end (their leases with them)
            s.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout)
        late = list(self._tasks)  # a handler stuck past the bound: cancelled (its leases end)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=self.timeout)

    def _admitted(self, sock: socket.socket, addr: str) -> None:
        task = asyncio.get_running_loop().create_task(self._connection(sock, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, sock: socket.socket, addr: str) -> None:
        where = _where(sock, addr)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol,
                sock,
                ssl=self.ssl,
                ssl_handshake_timeout=self.deadline if self.ssl is not None else None,
            )
        except (OSError, TimeoutError) as exc:  # a TLS handshake that failed or timed out
            sock.close()
            self.gate.closed(addr, authenticated=False)
            self.gate.failed(addr)
            self.audit.note(PROTOCOL_ERROR, where, "tls", detail=exc)
            return
        except BaseException:
            sock.close()
            self.gate.closed(addr, authenticated=False)
            raise
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        await self._serve(StreamSession(reader, writer, REQUEST_LIMITS), addr, where)

    async def _serve(self, session: StreamSession, addr: str, where: str) -> None:
        preauth = True
        self._sessions.add(session)
        owner = Peer()
        try:
            auth = await session.serve_handshake(
                self.secret, PAGE_SERVER, self._ident(), deadline=self.deadline
            )
            owner.tenant = self._tenant_of(auth)
            self.gate.authenticated(addr)
            preauth = False
            while (msg := await session.recv()) is not None:
                reply = self._answer(msg, owner, session, addr)
                rid = msg.get("id")
                await asyncio.wait_for(
                    session.send({"id": rid if type(rid) is int else None, **reply}), self.timeout
                )
        except AuthError as exc:
            self.audit.note(
                AUTH_REFUSED if preauth else PROTOCOL_ERROR,
                where,
                "bad proof" if preauth else "bad tag",
                detail=exc,
            )
        except (RemoteProtocolError, ProtocolError) as exc:
            self.audit.note(
                PROTOCOL_ERROR, where, "malformed", detail=exc, authenticated=not preauth
            )
        except (TimeoutError, TransportError):  # the hello deadline; a stuck reader
            self.audit.note(BUDGET_HIT, where, "hello_deadline" if preauth else "send_timeout")
        except ConnectionError:
            pass
        finally:
            if preauth:
                self.gate.failed(addr)  # every unauthenticated end counts toward a penalty
                session.writer.transport.abort()  # unread garbage: reset, nothing lingers
            self.gate.closed(addr, authenticated=not preauth)
            self._closed(owner)
            session.close()
            with contextlib.suppress(Exception):
                await session.writer.wait_closed()
            self._sessions.discard(session)


def _where(sock: socket.socket, addr: str) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return addr
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else addr
