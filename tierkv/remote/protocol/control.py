"""A control connection with a reader task: replies go to their callers, events to a handler.

Used by `RemoteTier`, and where the server speaks unasked: watches (eviction announcements)::

    Control(address, secret=s).open()  -> hello fields (after the mutual handshake of
                                          transports.session: the server proves the secret too)
    await ctl.call("watch", keys=[...])  -> reply (bounded by timeout; concurrent calls fine)
    server: {"ev": "gone", "keys": [...]}  -> await on_event(msg)  (the reader waits for it:
                                              a slow handler slows the socket, not the server)

When the connection ends (EOF, error, `aclose`) every call in flight raises PeerGoneError and
``closed`` (a future) resolves. A cancelled call leaves the connection as it was (frames are
written whole; its late reply is dropped by its id); a call that times out breaks it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable
from ssl import SSLContext
from typing import Any

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.remote.errors import (
    PeerGoneError,
    RemoteError,
    RemoteProtocolError,
    RemoteRefusedError,
    RemoteTimeoutError,
    TenantRefusedError,
)
from tierkv.remote.protocol.tenancy import TENANT_FIELD
from tierkv.remote.protocol.wire import CLIENT, PAGE_SERVER, REPLY_LIMITS, error_for
from tierkv.transports import AuthError, ProtocolError, TransferTimeoutError, TransportError
from tierkv.transports.session import StreamSession

__all__ = ["Control", "EventHandler"]

EventHandler = Callable[[dict[str, Any]], Awaitable[None]]


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port), the port in [1, 65535]. Raises InvalidTypeError (not a
    str: an AttributeError before), InvalidInputError (a ValueError; a port of 99999 was
    connect's OverflowError, and non-ASCII digits were taken as a port)."""
    if not isinstance(address, str):
        raise InvalidTypeError(f"address must be a 'host:port' str, got {type(address).__name__}")
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise InvalidInputError(
            f"address must be host:port with a port in [1, 65535], got {address!r:.80}"
        )
    return host, int(port)


class Control:
    """One authenticated control connection to a page server (inside TLS with ``ssl``, a
    client context), as ``tenant`` (None: none; then ``secret`` is that tenant's)."""

    def __init__(
        self,
        address: str,
        *,
        secret: bytes,
        timeout: float = 10.0,
        on_event: EventHandler | None = None,
        role: str = CLIENT,
        ident: str | None = None,
        ssl: SSLContext | None = None,
        tenant: str | None = None,
    ) -> None:
        self.ssl, self.tenant = ssl, tenant
        self.address = address
        self.host, self.port = split_address(address)
        self.secret, self.timeout = secret, timeout
        self.role, self.ident = role, ident or f"{CLIENT}-{os.getpid()}"
        self._on_event = on_event
        self._session: StreamSession | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.hello: dict[str, Any] = {}

    async def open(self) -> dict[str, Any]:
        """Connect and run the mutual handshake; returns the server's hello. Raises
        PeerGoneError, RemoteTimeoutError, RemoteRefusedError (refused, or a server that cannot
        prove the secret; TenantRefusedError: our tenant refused), RemoteProtocolError (the
        connection is closed then)."""
        what = f"no answer from {self.address}"
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=1 << 16, ssl=self.ssl),
                self.timeout,
            )
            self._session = StreamSession(reader, writer, REPLY_LIMITS)
            what = f"{self.address} silent for {self.timeout:g} s"  # connected, no handshake
            await self._session.client_handshake(
                self.secret,
                self.role,
                self.ident,
                deadline=self.timeout,
                expect_role=PAGE_SERVER,
                extra=None if self.tenant is None else {TENANT_FIELD: self.tenant},
            )
        except (TimeoutError, TransferTimeoutError) as exc:
            await self.aclose()
            raise RemoteTimeoutError(what) from exc
        except AuthError as exc:
            await self.aclose()
            if self.tenant is not None:
                raise TenantRefusedError(
                    f"auth: {self.address} refused tenant {self.tenant!r} (no such tenant, or "
                    f"not its secret): {exc}"
                ) from exc
            raise RemoteRefusedError(f"auth: {self.address}: {exc}") from exc
        except ProtocolError as exc:
            await self.aclose()
            raise RemoteProtocolError(f"{self.address}: {exc}") from exc
        except OSError as exc:
            await self.aclose()
            raise PeerGoneError(f"cannot reach the page server at {self.address}") from exc
        except BaseException:
            await self.aclose()
            raise
        self._reader_task = asyncio.get_running_loop().create_task(self._read(self._session))
        try:
            self.hello = await self.call("hello")
        except BaseException:
            await self.aclose()
            raise
        return self.hello

    @property
    def connected(self) -> bool:
        """True while calls can be sent (opened, not broken or closed)."""
        return self._session is not None and not self.closed.done()

    async def aclose(self) -> None:
        """Close the connection; calls in flight raise PeerGoneError. Idempotent."""
        if self._session is not None:
            self._session.close()
            self._session = None
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # bounded: a reader that does not end on cancel is left behind
            await asyncio.wait([task], timeout=self.timeout)
        self._end()

    def _break(self) -> None:
        if self._session is not None:
            self._session.close()  # the reader task sees EOF and ends every call in flight
            self._session = None

    def _end(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PeerGoneError(f"{self.address} closed the connection"))
                fut.exception()  # retrieved here: the caller re-raises it
        self._pending.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    async def _read(self, session: StreamSession) -> None:
        try:
            while (msg := await session.recv()) is not None:
                if "ev" in msg and "id" not in msg:
                    if self._on_event is not None:
                        await self._on_event(msg)
                    continue
                rid = msg.get("id")
                fut = self._pending.pop(rid, None) if type(rid) is int else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (RemoteError, TransportError, ConnectionError):
            pass  # a forged or malformed frame ends the connection like EOF
        finally:
            if self._session is session:
                session.close()
                self._session = None
            self._end()

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send a request and wait (bounded) for its reply. Raises PeerGoneError,
        RemoteTimeoutError, or the typed error of an ``err`` reply. Cancelled, it leaves the
        connection usable (the late reply is dropped)."""
        session = self._session
        if session is None or self.closed.done():
            raise PeerGoneError(f"not connected to {self.address}")
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            session.write({"op": op, "id": rid, **fields})  # whole, at once
            await asyncio.wait_for(session.writer.drain(), self.timeout)
            reply = await asyncio.wait_for(fut, self.timeout)
        except TimeoutError as exc:
            self._break()  # the server is stuck (or the socket is): start afresh
            raise RemoteTimeoutError(f"{self.address} silent for {self.timeout:g} s") from exc
        except (ConnectionError, RuntimeError) as exc:
            self._break()
            raise PeerGoneError(f"{self.address} gone while sending {op!r}") from exc
        finally:
            self._pending.pop(rid, None)
        if "err" in reply:
            raise error_for(reply)
        return reply
