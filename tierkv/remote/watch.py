"""Eviction announcements: a peer watches pages; the page server says when they leave.

::

    client  Watch.add(keys) --"watch"-->  server  WatchHub: key -> watchers
                                                 host tier: page evicted / dropped / moved
    client  async for gone in watch  <--{"ev": "gone", "keys"}--  per-watcher queue, batched

A key is announced once, then no longer watched (watch it again if it comes back). Each watcher
has a bounded queue of keys to announce and one sender task; a watcher whose queue overflows
or whose socket does not take a batch within the timeout is dropped (its connection closed),
never the server. On the client the reader waits for the consumer: a slow consumer slows its
own socket, which ends, on the server, in that bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from ssl import SSLContext
from typing import Any

from tierkv.remote.control import Control
from tierkv.remote.errors import PeerGoneError, RemoteError, RemoteProtocolError
from tierkv.transports.session import StreamSession

__all__ = ["Watch", "WatchHub"]

CHUNK = 16384  # keys per announcement frame


class _Watcher:
    __slots__ = ("keys", "pending", "session", "task", "wake")

    def __init__(self, session: StreamSession) -> None:
        self.session = session
        self.keys: set[bytes] = set()
        self.pending: list[bytes] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class WatchHub:
    """The page server's watchers. Used from its event loop.

    Args:
        max_pending: keys a watcher may have waiting to be announced before it is dropped.
        timeout: the longest one batch may take to be written to a watcher's socket.
    """

    def __init__(self, *, max_pending: int = 1 << 16, timeout: float = 5.0) -> None:
        self.max_pending, self.timeout = max_pending, timeout
        self._of: dict[object, _Watcher] = {}
        self._by_key: dict[bytes, set[_Watcher]] = {}
        self.announced = 0
        self.dropped = 0

    @property
    def watchers(self) -> int:
        """Connections watching at least one key now (or with announcements to send)."""
        return len(self._of)

    def watch(
        self,
        owner: object,
        session: StreamSession,
        keys: list[bytes],
        held: Callable[[bytes], bool],
    ) -> list[bool]:
        """Watch ``keys`` for ``owner`` (a connection); returns, per key, whether it is held now
        (keys not held are not watched: they are gone already)."""
        w = self._of.get(owner)
        if w is None:
            w = self._of[owner] = _Watcher(session)
            w.task = asyncio.get_running_loop().create_task(self._send(w))
        out = []
        for k in keys:
            here = held(k)
            out.append(here)
            if here and k not in w.keys:
                w.keys.add(k)
                self._by_key.setdefault(k, set()).add(w)
        return out

    def unwatch(self, owner: object, keys: Iterable[bytes]) -> None:
        """Stop watching ``keys`` for ``owner``."""
        w = self._of.get(owner)
        if w is not None:
            for k in keys:
                self._unlink(w, k)

    def _unlink(self, w: _Watcher, k: bytes) -> None:
        w.keys.discard(k)
        ws = self._by_key.get(k)
        if ws is not None:
            ws.discard(w)
            if not ws:
                del self._by_key[k]

    def announce(self, keys: Iterable[bytes]) -> None:
        """These pages left the host tier: queue them for their watchers (no wait)."""
        if not self._by_key:
            return
        for k in keys:
            ws = self._by_key.pop(k, None)
            if not ws:
                continue
            for w in ws:
                w.keys.discard(k)
                w.pending.append(k)
                w.wake.set()
                if len(w.pending) > self.max_pending:
                    self._drop(w)

    def close(self, owner: object) -> None:
        """The connection ended: forget its watches."""
        w = self._of.pop(owner, None)
        if w is not None:
            for k in list(w.keys):
                self._unlink(w, k)
            if w.task is not None:
                w.task.cancel()

    def close_all(self) -> None:
        """Forget every watcher (the server stops)."""
        for owner in list(self._of):
            self.close(owner)

    def _drop(self, w: _Watcher) -> None:
        self.dropped += 1
        w.pending.clear()
        w.session.close()  # its connection handler sees EOF and calls close(owner)
        for k in list(w.keys):
            self._unlink(w, k)

    async def _send(self, w: _Watcher) -> None:
        while True:
            await w.wake.wait()
            w.wake.clear()
            while w.pending:
                batch, w.pending = w.pending[:CHUNK], w.pending[CHUNK:]
                try:
                    await asyncio.wait_for(
                        w.session.send({"ev": "gone", "keys": batch}), self.timeout
                    )
                except (TimeoutError, ConnectionError, RuntimeError):
                    self._drop(w)
                    return
                self.announced += len(batch)


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
    ) -> None:
        self.address, self.secret, self.timeout = address, secret, timeout
        self.ssl = ssl
        self._callback = callback
        self._queue: asyncio.Queue[list[bytes]] = asyncio.Queue(max_batches)
        self.keys: set[bytes] = set()
        self._ctl: Control | None = None
        self._closed_by_us = False

    async def start(self) -> Watch:
        """Open the watch connection. Raises PeerGoneError, RemoteTimeoutError,
        RemoteRefusedError."""
        self._ctl = Control(
            self.address,
            secret=self.secret,
            timeout=self.timeout,
            on_event=self._event,
            ssl=self.ssl,
        )
        await self._ctl.open()
        return self

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
