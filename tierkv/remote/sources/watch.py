"""Eviction announcements, the client's end: `Watch` hears when watched pages leave a page
server's host tier (the server's end: tierkv.remote.server.watches; the messages:
tierkv.remote.protocol.wire)::

    client  Watch.add(keys) --"watch"-->  server  WatchHub: key -> watchers
    client  async for gone in watch  <--{"ev": "gone", "keys"}--  per-watcher queue, batched

The reader waits for the consumer: a slow consumer slows its own socket, which ends, on the
server, in its per-watcher bound (the watch is then closed: iteration raises PeerGoneError).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from tierkv import validate
from tierkv.remote.errors import PeerGoneError, RemoteError, RemoteProtocolError
from tierkv.remote.protocol.control import Control

__all__ = ["Watch"]


class Watch:
    """Announcements from one page server of watched pages leaving its host tier.

    Iterate it (``async for keys in watch``) for batches of departed keys, or pass
    ``callback`` (called with each batch instead). ``keys`` is the set still watched. The
    iteration raises PeerGoneError when the server closed the watch (it went away, or dropped
    this watcher for being too slow); it ends after `aclose`. Use as ``async with``.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: bytes,
        timeout: float = 10.0,
        callback: Callable[[list[bytes]], None] | None = None,
        max_batches: int = 256,
        ssl: SSLContext | None = None,
        tenant: str | None = None,
    ) -> None:
        timeout = validate.seconds("timeout", timeout)
        validate.count("max_batches", max_batches, 1)  # (0: an unbounded queue)
        self.address, self.secret, self.timeout = address, secret, timeout
        self.ssl, self.tenant = ssl, tenant
        self._callback = callback
        self._queue: asyncio.Queue[list[bytes]] = asyncio.Queue(max_batches)
        self.keys: set[bytes] = set()
        self._ctl: Control | None = None
        self._closed_by_us = False
        self._starting = asyncio.Lock()

    async def start(self) -> Watch:
        """Open the watch connection (open already: returns at once; a second connection
        replaced the first without closing it). Raises PeerGoneError, RemoteTimeoutError,
        RemoteRefusedError."""
        if self._ctl is not None and not self._closed_by_us:
            return self
        async with self._starting:  # (concurrent starts each opened one: all but one leaked)
            if self._ctl is None or self._closed_by_us:
                await self._open()
        return self

    async def _open(self) -> None:
        ctl = Control(
            self.address,
            secret=self.secret,
            timeout=self.timeout,
            on_event=self._event,
            ssl=self.ssl,
            tenant=self.tenant,
        )
        await ctl.open()
        self._ctl, self._closed_by_us = ctl, False

    async def _event(self, msg: dict[str, Any]) -> None:
        keys = msg.get("keys")
        if msg.get("ev") != "gone" or not isinstance(keys, list):
            raise RemoteProtocolError(f"unexpected event {msg.get('ev')!r}")
        gone = [k for k in keys if isinstance(k, bytes)]
        self.keys.difference_update(gone)
        if self._callback is not None:
            try:
                self._callback(gone)
            except Exception as exc:  # ends the watch (iteration raises) instead of the loop
                raise RemoteError(f"watch callback failed: {exc!r}") from exc
        else:
            await self._queue.put(gone)  # a slow consumer slows this socket only

    async def add(self, keys: list[bytes]) -> int:
        """Watch ``keys``; returns how many the server holds now (only those are watched)."""
        held = (await self._live().call("watch", keys=list(keys))).get("held")
        if not isinstance(held, list) or len(held) != len(keys):
            raise RemoteProtocolError("bad watch answer")
        self.keys.update(k for k, h in zip(keys, held) if h)
        return sum(1 for h in held if h)

    async def remove(self, keys: list[bytes]) -> None:
        """Stop watching ``keys``."""
        await self._live().call("unwatch", keys=list(keys))
        self.keys.difference_update(keys)

    def _live(self) -> Control:
        if self._ctl is None:
            raise PeerGoneError("the watch is not started")
        return self._ctl

    async def aclose(self) -> None:
        """Close the watch connection. Idempotent."""
        self._closed_by_us = True
        if self._ctl is not None:
            await self._ctl.aclose()

    async def __aenter__(self) -> Watch:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> list[bytes]:
        if not self._queue.empty():
            return self._queue.get_nowait()
        ctl = self._live()
        if ctl.closed.done():
            if self._closed_by_us:
                raise StopAsyncIteration
            raise PeerGoneError(f"the watch on {self.address} was closed by the server")
        get: asyncio.Future[list[bytes]] = asyncio.ensure_future(self._queue.get())
        ended: asyncio.Future[Any] = ctl.closed
        try:
            await asyncio.wait([get, ended], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await get
        if get.done() and not get.cancelled():
            return get.result()
        return await self.__anext__()
