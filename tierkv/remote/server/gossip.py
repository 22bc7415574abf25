"""The directory kept by the page servers themselves: which node holds which content page.

Each server links to its peers (a control connection each, authenticated like any client) and
tells them what its host tier holds: the whole set when the link (re)connects, then batched
changes, at most every ``interval`` seconds, sooner when pages leave::

    server A  PeerLink(B) --hold {node: A, full, add, drop}-->  server B  PeerIndex: A -> keys
              <-- {"peers": [A, B, C]} (B's known nodes: A links to those it lacks)
              <-- {"ev": "hold", full, add, drop}   BackLink(A): B's holdings, on A's connection
    PeerIndex: B -> keys

A node's entries live as long as the connection that brought them: a peer that goes away
(closed, frozen past the timeout) drops out of every `locate` answer. One seed is enough: a
server that hears from an unknown page server answers with its own holdings on that same
connection (it never dials an address a caller names), and each reply lists the known nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from ssl import SSLContext
from typing import Any

from tierkv.failures import FailureLog
from tierkv.remote.errors import RemoteError, RemoteProtocolError
from tierkv.remote.protocol.control import Control
from tierkv.remote.protocol.wire import MAX_KEYS, PAGE_SERVER
from tierkv.transports import TransportError
from tierkv.transports.session import StreamSession

__all__ = ["BackLink", "Outbox", "PeerIndex", "PeerLink", "keys_field"]

#: send(add, drop, full) -> the peer's reply (empty for an event)
Send = Callable[[list[bytes], list[bytes], bool], Awaitable[dict[str, Any]]]
#: on_hold(node, owner, add, drop, full): a peer's holdings heard on connection ``owner``
OnHold = Callable[[str, object, list[bytes], list[bytes], bool], None]

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


class Outbox:
    """Our holdings as one peer has yet to hear them: everything (after a (re)connect, or when
    too many changes pile up) or the changes since the last flush."""

    def __init__(self, held: Callable[[], set[bytes]], max_pending: int) -> None:
        self._held, self.max_pending = held, max_pending
        self._add: set[bytes] = set()
        self._drop: set[bytes] = set()
        self.full = True
        self.wake = asyncio.Event()

    def reset(self) -> None:
        """The next flush sends everything."""
        self.full = True
        self._add.clear()
        self._drop.clear()

    def changed(self, add: Iterable[bytes], drop: Iterable[bytes]) -> None:
        """Our holdings changed: queue the change (a full resend if too much piles up)."""
        if self.full:
            return  # the next flush sends everything
        for k in drop:
            self._add.discard(k)
            self._drop.add(k)
        for k in add:
            self._drop.discard(k)
            self._add.add(k)
        if len(self._add) + len(self._drop) > self.max_pending:
            self.reset()
        self.wake.set()

    async def flush(self, send: Send) -> dict[str, Any]:
        """Send what is queued, in chunks of CHUNK keys; returns the last reply."""
        if self.full:
            self.full = False
            self._add.clear()
            self._drop.clear()
            everything = list(self._held())
            reply = await send(everything[:CHUNK], [], True)
            for i in range(CHUNK, len(everything), CHUNK):
                reply = await send(everything[i : i + CHUNK], [], False)
            return reply
        add, drop = list(self._add), list(self._drop)
        self._add.clear()
        self._drop.clear()
        reply = await send(add[:CHUNK], drop[:CHUNK], False)
        for i in range(CHUNK, max(len(add), len(drop)), CHUNK):
            reply = await send(add[i : i + CHUNK], drop[i : i + CHUNK], False)
        return reply


def hold_event(msg: dict[str, Any], node: str, owner: object, on_hold: OnHold) -> None:
    """Apply a peer's ``{"ev": "hold"}`` (heard on our link ``owner`` to ``node``). Raises
    RemoteProtocolError for a malformed one (the link then reconnects)."""
    if msg.get("ev") == "hold":
        full = bool(msg.get("full"))
        on_hold(node, owner, keys_field(msg, "add"), keys_field(msg, "drop"), full)


class BackLink:
    """Our holdings pushed to a page server that linked to us, as events on its own
    connection: so it learns them without our dialing the address it claims."""

    def __init__(
        self,
        session: StreamSession,
        node: str,
        *,
        held: Callable[[], set[bytes]],
        timeout: float,
        max_pending: int = 1 << 18,
    ) -> None:
        self.session, self.node, self.timeout = session, node, timeout
        self.outbox = Outbox(held, max_pending)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start pushing (a full snapshot first)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def close(self) -> None:
        """Stop pushing (its connection ended, or we are closing)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    def changed(self, add: Iterable[bytes], drop: Iterable[bytes]) -> None:
        """Our holdings changed."""
        self.outbox.changed(add, drop)

    async def _run(self) -> None:
        with contextlib.suppress(TimeoutError, ConnectionError, TransportError):
            while True:
                await self.outbox.flush(self._send)
                await self.outbox.wake.wait()
                self.outbox.wake.clear()
        self.session.close()  # a peer that cannot take our holdings: it reconnects afresh

    async def _send(self, add: list[bytes], drop: list[bytes], full: bool) -> dict[str, Any]:
        event = {"ev": "hold", "add": add, "drop": drop, "full": full}
        await asyncio.wait_for(self.session.send(event), self.timeout)
        return {}


class PeerLink:
    """This server's link to one peer: our holdings out, the peer's known nodes back.

    Args:
        me: our address, as peers reach us.
        peer: the peer's address.
        held: our holdings now (a full snapshot is sent on every (re)connect).
        on_peers: called with the node addresses the peer knows.
        on_hold: the peer's holdings, as it pushes them on our link (`BackLink`); they are
            forgotten when the link drops.
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
        on_hold: OnHold,
        forget: Callable[[object], None],
        max_pending: int = 1 << 18,
        ssl: SSLContext | None = None,
    ) -> None:
        self.ssl = ssl
        self.me, self.peer = me, peer
        self.secret, self.timeout, self.interval = secret, timeout, interval
        self._on_peers, self._on_hold, self._forget = on_peers, on_hold, forget
        self.outbox = Outbox(held, max_pending)
        self.connected = False
        self.failures = 0
        self.ever_connected = False
        self.last_error = ""
        self._failures = FailureLog("tierkv.remote.gossip")  # each failure logged, rate limited
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
        self.outbox.changed(add, drop)

    async def _event(self, msg: dict[str, Any]) -> None:
        hold_event(msg, self.peer, self, self._on_hold)

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
                on_event=self._event,
            )
            try:
                await ctl.open()
                self.connected = True
                self.ever_connected = True
                backoff = 0.05
                self.outbox.reset()
                while True:
                    await self._flush(ctl)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.outbox.wake.wait(), self.interval)
                    self.outbox.wake.clear()
            except (RemoteError, OSError) as exc:
                self.failures += 1
                self.last_error = self._failures.report(f"link to {self.peer}", exc, tier="peer")
            finally:
                self.connected = False
                self.outbox.reset()
                self._forget(self)  # what the peer pushed on this link
                await ctl.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max(self.interval, 1.0))

    async def _flush(self, ctl: Control) -> None:
        async def send(add: list[bytes], drop: list[bytes], full: bool) -> dict[str, Any]:
            return await ctl.call("hold", node=self.me, add=add, drop=drop, full=full)

        peers = (await self.outbox.flush(send)).get("peers")
        if isinstance(peers, list):
            self._on_peers([p for p in peers if isinstance(p, str)])
