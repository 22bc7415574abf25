"""Eviction announcements, the server's end: a peer watches pages; we say when they leave.

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
from collections.abc import Callable, Iterable

from tierkv.transports.session import StreamSession

__all__ = ["WatchHub"]

CHUNK = 16384  # keys per announcement frame


class _Watcher:
    __slots__ = ("keys", "names", "pending", "session", "task", "wake")

    def __init__(self, session: StreamSession) -> None:
        self.session = session
        self.keys: set[bytes] = set()
        self.names: dict[bytes, bytes] = {}  # key -> the key as the watcher named it
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
        names: list[bytes] | None = None,
    ) -> list[bool]:
        """Watch ``keys`` for ``owner`` (a connection); returns, per key, whether it is held now
        (keys not held are not watched: they are gone already). ``names``: the keys as the
        watcher knows them, announced in their place (a tenant's, tenancy.py)."""
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
                if names is not None:
                    w.names[k] = names[len(out) - 1]
        return out

    def unwatch(self, owner: object, keys: Iterable[bytes]) -> None:
        """Stop watching ``keys`` for ``owner``."""
        w = self._of.get(owner)
        if w is not None:
            for k in keys:
                self._unlink(w, k)

    def _unlink(self, w: _Watcher, k: bytes) -> None:
        w.keys.discard(k)
        w.names.pop(k, None)
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
                w.pending.append(w.names.pop(k, k))
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
