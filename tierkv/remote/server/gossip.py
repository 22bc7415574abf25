"""The directory kept by the page servers themselves: which node holds which content page.

Each server links to its peers (a control connection each, authenticated like any client) and
tells them what its host tier holds: the whole set when the link (re)connects, then batched
changes, at most every ``interval`` seconds, sooner when pages leave::

    server A  PeerLink(B) --hold {node: A, full, add, drop}-->  server B  PeerIndex: A -> keys
              <-- {"peers": [A, B, C]} (B's known nodes: A links to those it lacks)

A node's entries live as long as the connection that brought them: a peer that goes away
(closed, frozen past the timeout) drops out of every `locate` answer. One seed is enough:
a server that hears from an unknown node links back, and each reply lists the known nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from ssl import SSLContext
from typing import Any

from tierkv.remote.errors import RemoteError, RemoteProtocolError
from tierkv.remote.protocol.control import Control
from tierkv.remote.protocol.wire import MAX_KEYS, PAGE_SERVER

__all__ = ["PeerIndex", "PeerLink", "keys_field"]

CHUNK = 16384  # keys per hold message


def keys_field(msg: dict[str, Any], name: str) -> list[bytes]:
    """A list-of-keys field (absent: empty). Raises RemoteProtocolError."""
    keys = msg.get(name, [])
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise RemoteProtocolError(f"{name} must be a list of at most {MAX_KEYS} byte strings")
    if not all(isinstance(k, bytes) and 0 < len(k) <= 64 for k in keys):
        raise RemoteProtocolError(f"every key of {name} must be 1 to 64 bytes")
    return keys


class PeerIndex:
    """What each peer node holds, and the reverse: which nodes hold a page.

    A connection speaks for at most ``max_nodes`` nodes with at most ``max_keys`` entries in
    all: an authenticated client cannot grow the index without bound.
    """

    def __init__(self, max_keys: int = 1 << 21, max_nodes: int = 16) -> None:
        self.max_keys, self.max_nodes = max_keys, max_nodes
        self.nodes: dict[str, set[bytes]] = {}
        self._owner: dict[str, object] = {}
        self._where: dict[bytes, list[str]] = {}

    def apply(
        self, node: str, owner: object, add: Iterable[bytes], drop: Iterable[bytes], full: bool
    ) -> None:
        """Record a hold message from ``node`` (received on connection ``owner``). Raises
        RemoteProtocolError, recording nothing, when ``owner`` would speak for more than
        ``max_nodes`` nodes or hold more than ``max_keys`` entries."""
        add, drop = list(add), list(drop)
        mine = [n for n, o in self._owner.items() if o is owner]
        if node not in mine and len(mine) >= self.max_nodes:
            raise RemoteProtocolError(f"a connection speaks for at most {self.max_nodes} nodes")
        kept = 0 if full or node not in mine else len(self.nodes.get(node, ()))
        others = sum(len(self.nodes.get(n, ())) for n in mine if n != node)
        if others + kept + len(add) > self.max_keys:
            raise RemoteProtocolError(f"a connection holds at most {self.max_keys} entries")
        if full or self._owner.get(node) is not owner:
            self.forget(node)
            self._owner[node] = owner
        held = self.nodes.setdefault(node, set())
        for k in drop:
            if k in held:
                held.discard(k)
                self._unplace(k, node)
        for k in add:
            if k not in held:
                held.add(k)
                self._where.setdefault(k, []).append(node)

    def _unplace(self, k: bytes, node: str) -> None:
        where = self._where.get(k)
        if where is not None:
            with contextlib.suppress(ValueError):
                where.remove(node)
            if not where:
                del self._where[k]

    def forget(self, node: str, owner: object | None = None) -> None:
        """Drop ``node``'s entries (only if they came on ``owner``, when given)."""
        if owner is not None and self._owner.get(node) is not owner:
            return
        self._owner.pop(node, None)
        for k in self.nodes.pop(node, set()):
            self._unplace(k, node)

    def forget_owner(self, owner: object) -> None:
        """A connection ended: drop the entries of every node it spoke for."""
        for node in [n for n, o in self._owner.items() if o is owner]:
            self.forget(node)

    def locate(self, key: bytes) -> str | None:
        """A node holding ``key``, or None."""
        where = self._where.get(key)
        return where[0] if where else None

    def pages(self) -> int:
        """Entries over every node."""
        return sum(len(v) for v in self.nodes.values())


class PeerLink:
    """This server's link to one peer: our holdings out, the peer's known nodes back.

    Args:
        me: our address, as peers reach us.
        peer: the peer's address.
        held: our holdings now (a full snapshot is sent on every (re)connect).
        on_peers: called with the node addresses the peer knows.
        interval: seconds between messages when nothing changes (the liveness check).
    """

    def __init__(
        self,
        me: str,
        peer: str,
        *,
        secret: bytes,
        timeout: float,
        interval: float,
        held: Callable[[], set[bytes]],
        on_peers: Callable[[list[str]], None],
        max_pending: int = 1 << 18,
        ssl: SSLContext | None = None,
    ) -> None:
        self.ssl = ssl
        self.me, self.peer = me, peer
        self.secret, self.timeout, self.interval = secret, timeout, interval
        self._held, self._on_peers = held, on_peers
        self.max_pending = max_pending
        self._add: set[bytes] = set()
        self._drop: set[bytes] = set()
        self._full = True
        self._wake = asyncio.Event()
        self.connected = False
        self.failures = 0
        self.ever_connected = False
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start linking (reconnects with backoff until `aclose`)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        """Stop the link."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def changed(self, add: Iterable[bytes], drop: Iterable[bytes]) -> None:
        """Our holdings changed: queue the change (a full resend if too much piles up)."""
        if self._full:
            return  # the next connect sends everything
        for k in drop:
            self._add.discard(k)
            self._drop.add(k)
        for k in add:
            self._drop.discard(k)
            self._add.add(k)
        if len(self._add) + len(self._drop) > self.max_pending:
            self._full = True
            self._add.clear()
            self._drop.clear()
        self._wake.set()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            ctl = Control(
                self.peer,
                secret=self.secret,
                timeout=self.timeout,
                role=PAGE_SERVER,
                ident=self.me,
                ssl=self.ssl,
            )
            try:
                await ctl.open()
                self.connected = True
                self.ever_connected = True
                backoff = 0.05
                self._full = True
                while True:
                    await self._flush(ctl)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.interval)
                    self._wake.clear()
            except (RemoteError, OSError) as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self.connected = False
                self._full = True
                await ctl.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max(self.interval, 1.0))

    async def _flush(self, ctl: Control) -> None:
        if self._full:
            self._full = False
            self._add.clear()
            self._drop.clear()
            everything = list(self._held())
            reply = await self._send(ctl, everything[:CHUNK], [], full=True)
            for i in range(CHUNK, len(everything), CHUNK):
                reply = await self._send(ctl, everything[i : i + CHUNK], [], full=False)
        else:
            add, drop = list(self._add), list(self._drop)
            self._add.clear()
            self._drop.clear()
            reply = await self._send(ctl, add[:CHUNK], drop[:CHUNK], full=False)
            for i in range(CHUNK, max(len(add), len(drop)), CHUNK):
                reply = await self._send(ctl, add[i : i + CHUNK], drop[i : i + CHUNK], False)
        peers = reply.get("peers")
        if isinstance(peers, list):
            self._on_peers([p for p in peers if isinstance(p, str)])

    async def _send(
        self, ctl: Control, add: list[bytes], drop: list[bytes], full: bool
    ) -> dict[str, Any]:
        return await ctl.call("hold", node=self.me, add=add, drop=drop, full=full)
